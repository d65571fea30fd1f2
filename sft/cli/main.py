"""The `sft` command: verbs over recipes; config and data errors exit 2 without a traceback."""

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable

from sft.cli.console import (
    closed_stdout,
    end_distributed,
    is_replica,
    quiet_optional_backends,
    recipe_keys_help,
    setup_logging,
)
from sft.config.names import DISTRIBUTED_PRESETS, DTYPE_NAMES
from sft.errors import SFTError

log = logging.getLogger("sft")
DESCRIPTION = "Supervised fine-tuning of language models from YAML recipes, on transformers.Trainer."
RECIPE_HELP = ("Any recipe key can be overridden as --key value or --key=value (booleans: --packing true). "
               "Keys are SFTConfig fields: the model/data/SFT fields below plus every transformers "
               "TrainingArguments field.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sft` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    collision = debug_collision(argv)
    argv = [a for a in argv if a != "--debug"]
    setup_logging()
    quiet_optional_backends()
    if collision:
        print(f"sft: error: {collision}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.debug = debug
    try:
        if args.verb is None:
            parser.print_help()
            return 0
        code = args.run(args, rest) or 0
        end_distributed()
        return code
    except SFTError as err:
        end_distributed(err)  # after a stop all ranks agreed on (a signal, divergence), as on success
        if debug:
            raise
        print(f"sft: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("sft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `sft ... --help | head`: the reader wants no more output, and no traceback
        return closed_stdout()


def debug_collision(argv: list[str]) -> str | None:
    """`--debug VALUE` would be read as sft's traceback switch plus a stray VALUE; say how to set the
    TrainingArguments field of the same name instead."""
    from transformers.debug_utils import DebugOption

    values = {option.value for option in DebugOption}
    for arg, following in zip(argv, argv[1:]):
        if arg == "--debug" and following in values:
            return (f"`--debug` alone is sft's switch for full tracebacks; to set TrainingArguments' debug option "
                    f"write --debug={following} (or `debug: {following}` in the recipe).")
    return None


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per verb."""
    parser = argparse.ArgumentParser(prog="sft", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    add_recipe_verb(verbs, "train", "fine-tune a model from a recipe", run_train)
    data = add_recipe_verb(verbs, "data", "tokenize a recipe's data and print its statistics", run_data)
    data.add_argument("--show", type=int, default=0, metavar="N", help="render N examples, trained tokens marked")
    data.add_argument("--json", action="store_true", help="print the statistics as JSON")
    verbs.add_parser("alpaca", help="Stanford Alpaca train.py command line (same flags)", add_help=False).set_defaults(
        run=run_alpaca)
    add_recipe_verb(verbs, "eval", "teacher-forced eval loss (and perplexity) of a recipe's model on its eval set",
                    run_eval)
    add_inference_verbs(verbs)
    check = add_recipe_verb(verbs, "check", "dry-run a recipe on CPU with a tiny model of its architecture", run_check)
    check.add_argument("--prove", action="store_true", help="prove masks, packing, batching, resume, save/load and "
                       "generation eval on the recipe's data and template (exit 1 when a proof fails)")
    check.add_argument("--rows", type=int, default=32, metavar="N", help="rows the mask proof samples (default 32)")
    check.add_argument("--json", action="store_true", help="with --prove: one JSON object per proof")
    add_launch_verb(verbs)
    add_plan_verb(verbs)
    listing = verbs.add_parser("recipes", help="list the shipped recipes")
    listing.add_argument("--dir", help="recipes folder (default: ./recipes, else the one beside the package)")
    listing.set_defaults(run=run_recipes)
    return parser


def add_recipe_verb(verbs: argparse._SubParsersAction, name: str, summary: str,
                    run: Callable) -> argparse.ArgumentParser:
    """A verb taking RECIPE plus --key value overrides; its --help lists every recipe key."""
    sub = verbs.add_parser(name, help=summary, description=f"{summary}. {RECIPE_HELP}", add_help=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("recipe", nargs="?", help="path to a YAML recipe")
    sub.add_argument("-h", "--help", action="store_true", help="show every recipe key with its help")
    sub.set_defaults(run=with_help(sub, run))
    return sub


def with_help(sub: argparse.ArgumentParser, run: Callable) -> Callable:
    """Wrap a verb so --help prints the verb usage followed by every recipe key's help."""

    def runner(args: argparse.Namespace, rest: list[str]) -> int | None:
        if args.help:
            print(sub.format_help())
            print(recipe_keys_help())
            return 0
        if args.recipe is None:
            raise SFTError(f"sft {args.verb}: give a recipe, e.g. `sft {args.verb} recipes/quickstart.yaml`.")
        # `sft train --max_steps 1 r.yaml`: argparse takes `1` for the recipe ("Recipe 1 does not exist")
        misplaced = next((a for a in rest if a.endswith((".yaml", ".yml")) and Path(a).is_file()), None)
        if misplaced and not Path(args.recipe).is_file():
            raise SFTError(f"sft {args.verb}: the recipe goes right after the verb, before the --key value flags: "
                           f"sft {args.verb} {misplaced} --key value (`{args.recipe}` stood where the recipe goes).")
        return run(args, rest)

    return runner


def run_train(args: argparse.Namespace, rest: list[str]) -> None:
    """sft train RECIPE [--key value ...]"""
    from sft.training.flows import train
    from sft.training.recipe import load_recipe

    out = train(load_recipe(args.recipe, flags=rest))
    log.info("Done. Model, tokenizer, recipe.yaml, metrics, loss.png and README.md are in %s", out)


def run_data(args: argparse.Namespace, rest: list[str]) -> None:
    """sft data RECIPE [--show N] [--json]"""
    import json

    from sft.data.describe import describe_data
    from sft.training.recipe import load_recipe

    stats, shown = describe_data(load_recipe(args.recipe, flags=rest), show=args.show, color=sys.stdout.isatty())
    print(json.dumps(stats.as_dict(), indent=2) if args.json else stats.table("Training data"))
    if shown:
        print(shown)


def run_eval(args: argparse.Namespace, rest: list[str]) -> None:
    """sft eval RECIPE [--key value ...]"""
    from sft.training.flows import evaluate
    from sft.training.recipe import load_recipe

    metrics = evaluate(load_recipe(args.recipe, flags=rest))
    if not is_replica():
        print("\n".join(f"{k:<28} {v:.6g}" if isinstance(v, float) else f"{k:<28} {v}" for k, v in metrics.items()))


def add_inference_verbs(verbs: argparse._SubParsersAction) -> None:
    """sft merge, sft generate and sft chat: verbs on a trained model or adapter folder."""
    merge = verbs.add_parser("merge", help="merge a LoRA adapter into its base model",
                             description="Merge a LoRA adapter into the base model named in its adapter_config.json "
                                         "and save a plain transformers model (safetensors, tokenizer, chat template).")
    merge.add_argument("adapter_dir", help="output_dir (or checkpoint-N folder) of a use_peft run")
    merge.add_argument("output_dir",
                       help="folder for the merged model, outside the run: new, empty, or an earlier merge "
                            "(with --overwrite)")
    merge.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="weights dtype (auto: the base's)")
    merge.add_argument("--overwrite", action="store_true",
                       help="replace an earlier merge sft wrote there (never other files)")
    merge.add_argument("--base_model", help="merge into this base instead of the one in adapter_config.json")
    add_allow_pickle(merge)
    merge.set_defaults(run=run_merge)
    generate = verbs.add_parser("generate", help="generate a reply to one prompt",
                                description="Generate a reply to --prompt with the model's chat template, or the "
                                            "Alpaca prompt when it has none, and print it. An encoder-decoder (T5, "
                                            "BART) reads the prompt as is.")
    add_generation_options(generate)
    generate.add_argument("--prompt", required=True, help="the user message")
    generate.set_defaults(run=run_generate)
    chat = verbs.add_parser("chat", help="chat with a model interactively",
                            description="Chat with a model, replies streamed. /reset clears the conversation, "
                                        "/exit quits. Reads stdin line by line, so it also works on a pipe. An "
                                        "encoder-decoder (T5, BART) answers each message on its own.")
    add_generation_options(chat)
    chat.set_defaults(run=run_chat)


def add_generation_options(sub: argparse.ArgumentParser) -> None:
    """The model folder and decoding options shared by generate and chat."""
    sub.add_argument("model_dir", help="a model folder, or an adapter folder (its base is loaded too)")
    sub.add_argument("--max_new_tokens", type=int, default=256, help="most tokens to generate (default 256)")
    sub.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    sub.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --do_sample)")
    sub.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass (with --do_sample)")
    sub.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    sub.add_argument("--system", help="system prompt (chat templates only)")
    sub.add_argument("--template", choices=("auto", "chat", "alpaca"), default="auto",
                     help="prompt format: the tokenizer's chat template, or the Alpaca prompt that alpaca data trains "
                          "on (auto: what an sft run trained on, from its data_stats.json; else the chat template "
                          "if the tokenizer has one; for an encoder-decoder, the message as is)")
    sub.add_argument("--chat_template_kwargs", help="chat template variables as a YAML mapping, e.g. "
                     "'{enable_thinking: false}' (default: those the run trained with, from its data_stats.json)")
    sub.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="weights dtype (auto: as saved)")
    sub.add_argument("--base_model", help="for adapters: use this base instead of the one in adapter_config.json")
    add_allow_pickle(sub)


def add_allow_pickle(sub: argparse.ArgumentParser) -> None:
    """--allow_pickle, the inference verbs' form of the recipe key allow_pickle (sft.models.weights decides)."""
    sub.add_argument("--allow_pickle", action="store_true", help="also load pickled .bin weights (model or adapter) "
                     "where there are no safetensors; loading them can run arbitrary code, so only ones you trust")


def reject_extra(rest: list[str]) -> None:
    """Recipe verbs take --key value overrides; these verbs take only their own options."""
    if rest:
        raise SFTError(f"unrecognized arguments: {' '.join(rest)} (see --help)")


def run_merge(args: argparse.Namespace, rest: list[str]) -> None:
    """sft merge ADAPTER_DIR OUTPUT_DIR [--dtype D] [--overwrite] [--base_model M] [--allow_pickle]"""
    from transformers import AutoConfig

    from sft.models.export import merge_adapter
    from sft.models.loading import auto_model_class

    reject_extra(rest)
    out = merge_adapter(args.adapter_dir, args.output_dir, args.dtype, args.overwrite, args.base_model,
                        args.allow_pickle)
    log.info("Done. Load it with %s.from_pretrained(%r)", auto_model_class(AutoConfig.from_pretrained(out)).__name__,
             str(out))


def load_for_verb(args: argparse.Namespace, rest: list[str]) -> tuple:
    """(model, tokenizer, options) for generate and chat."""
    from sft.evaluation.generation import GenerationOptions, prompt_template_kwargs, trained_template
    from sft.models.saved import load_for_inference

    reject_extra(rest)
    template = (trained_template(args.model_dir) if args.template == "auto" else None) or args.template
    if template != args.template:
        log.info("Prompting with the %s format %s was trained on (--template chat or alpaca to choose).",
                 "Alpaca prompt" if template == "alpaca" else "chat template", args.model_dir)
    options = GenerationOptions(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                                temperature=args.temperature, top_p=args.top_p, seed=args.seed, template=template,
                                chat_template_kwargs=prompt_template_kwargs(args.chat_template_kwargs, args.model_dir))
    options.check()  # before the model loads
    model, tokenizer = load_for_inference(args.model_dir, args.dtype, args.base_model, allow_pickle=args.allow_pickle)
    return model, tokenizer, options


def run_generate(args: argparse.Namespace, rest: list[str]) -> None:
    """sft generate MODEL_OR_ADAPTER_DIR --prompt TEXT [decoding options]"""
    from sft.cli.chat import start_conversation
    from sft.evaluation.generation import generate

    model, tokenizer, options = load_for_verb(args, rest)
    messages = start_conversation(args.system) + [{"role": "user", "content": args.prompt}]
    print(generate(model, tokenizer, messages, options))


def run_chat(args: argparse.Namespace, rest: list[str]) -> None:
    """sft chat MODEL_OR_ADAPTER_DIR [decoding options]"""
    from sft.cli.chat import chat

    model, tokenizer, options = load_for_verb(args, rest)
    chat(model, tokenizer, options, system=args.system)


def run_alpaca(args: argparse.Namespace, rest: list[str]) -> int:
    """sft alpaca --model_name_or_path M --data_path D ... (Stanford Alpaca train.py flags)"""
    from sft.cli.alpaca import main as alpaca_main

    return alpaca_main(rest)


def run_recipes(args: argparse.Namespace, rest: list[str]) -> None:
    """sft recipes [--dir DIR]"""
    from sft.training.catalog import list_recipes, recipes_table

    reject_extra(rest)
    print(recipes_table(list_recipes(Path(args.dir) if args.dir else None)))


def run_check(args: argparse.Namespace, rest: list[str]) -> int:
    """sft check RECIPE [--prove [--rows N] [--json]] [--key value ...]"""
    if not args.prove:
        from sft.check.smoke import check_recipe

        print(check_recipe(args.recipe, flags=rest).table())
        return 0
    if args.rows < 1:  # 0 ran every proof (a minute) to fail the mask proof on no row
        raise SFTError(f"--rows must be at least 1, got {args.rows}: it is how many rows the mask proof checks.")
    import json

    from sft.check.prove import prove_recipe

    proofs = prove_recipe(args.recipe, flags=rest, rows=args.rows, debug=args.debug)
    print(json.dumps([p.as_dict() for p in proofs], indent=2) if args.json else "\n".join(p.line() for p in proofs))
    return 1 if any(p.passed is False for p in proofs) else 0


def add_plan_verb(verbs: argparse._SubParsersAction) -> None:
    """sft plan RECIPE [--gpu G] [--num_gpus N] [--num_nodes M] [--json] [--trace] [recipe overrides]"""
    from sft.planning.hardware import DEFAULT_GPU

    plan = add_recipe_verb(verbs, "plan", "will a recipe fit on a GPU, how fast will it run, which setting makes "
                                          "it fit (offline, in seconds)", run_plan)
    plan.add_argument("--gpu", default=DEFAULT_GPU,
                      help=f"GPU kind (default {DEFAULT_GPU}; see sft/planning/hardware.py)")
    plan.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default 1)")
    plan.add_argument("--num_nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--trace", action="store_true", help="also simulate one training step with fake tensors "
                                                           "(MemTracker) and print its peak")


def run_plan(args: argparse.Namespace, rest: list[str]) -> None:
    """sft plan RECIPE [--gpu G] [--num_gpus N] [--num_nodes M] [--json] [--trace] [--key value ...]"""
    import json

    from sft.planning.hardware import find_gpu
    from sft.planning.plan import plan_recipe
    from sft.training.recipe import load_recipe

    gpu = find_gpu(args.gpu)
    config = load_recipe(args.recipe, flags=rest)
    plan = plan_recipe(config, gpu, args.num_gpus, args.num_nodes)
    if args.trace:
        from sft.planning.plan import trace_note

        plan.notes.append(trace_note(config, plan))
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.table(args.recipe))


def add_launch_verb(verbs: argparse._SubParsersAction) -> None:
    """sft launch RECIPE [--preset P] [--num_processes N] [--dry_run] [accelerate flags] [recipe overrides]"""
    launch = add_recipe_verb(verbs, "launch", "train on several GPUs or machines via accelerate launch", run_launch)
    launch.add_argument("--preset", choices=DISTRIBUTED_PRESETS,
                        help="accelerate/DeepSpeed preset (default: the recipe's `distributed`, else ddp)")
    launch.add_argument("--num_processes", type=int, help="processes over all machines (default: GPUs x machines)")
    launch.add_argument("--dry_run", action="store_true", help="print the accelerate command instead of running it")
    launch.epilog = ("Flags `accelerate launch` knows (--num_machines, --machine_rank, --main_process_ip, "
                     "--main_process_port, ...) go to accelerate, except the recipe key "
                     "--gradient_accumulation_steps; every other flag, and all after `--`, overrides a recipe key. "
                     "See docs/distributed.md.")


def run_launch(args: argparse.Namespace, rest: list[str]) -> int:
    """sft launch RECIPE [--preset P] [--num_processes N] [--dry_run] [accelerate flags] [--key value ...]"""
    from sft.cli.launch import launch

    return launch(args.recipe, rest, args.preset, args.num_processes, args.dry_run)
