"""The `sft` command: verbs over recipes; config and data errors exit 2 without a traceback."""

import argparse
import logging
import sys
from typing import Callable

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
    argv = [a for a in argv if a != "--debug"]
    setup_logging()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.verb is None:
        parser.print_help()
        return 0
    try:
        return args.run(args, rest) or 0
    except SFTError as err:
        if debug:
            raise
        print(f"sft: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("sft: interrupted", file=sys.stderr)
        return 130


def setup_logging() -> None:
    """Readable INFO logs from sft and transformers' Trainer."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("sft").setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per verb."""
    parser = argparse.ArgumentParser(prog="sft", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    add_recipe_verb(verbs, "train", "fine-tune a model from a recipe", run_train)
    data = add_recipe_verb(verbs, "data", "tokenize a recipe's data and print its statistics", run_data)
    data.add_argument("--show", type=int, default=0, metavar="N", help="render N examples, trained tokens marked")
    data.add_argument("--json", action="store_true", help="print the statistics as JSON")
    add_recipe_verb(verbs, "eval", "teacher-forced eval loss (and perplexity) of a recipe's model on its eval set",
                    run_eval)
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
        return run(args, rest)

    return runner


def recipe_keys_help() -> str:
    """Every recipe key with its type and help text, from the SFTConfig dataclass."""
    from transformers import HfArgumentParser

    from sft.config import SFTConfig

    text = HfArgumentParser(SFTConfig, prog="sft").format_help()
    return "recipe keys:" + text.split("options:", 1)[-1]


def run_train(args: argparse.Namespace, rest: list[str]) -> None:
    """sft train RECIPE [--key value ...]"""
    from sft.recipe import load_recipe
    from sft.training import train

    out = train(load_recipe(args.recipe, flags=rest))
    log.info("Done. Model, tokenizer, recipe.yaml, metrics, loss.png and README.md are in %s", out)


def run_data(args: argparse.Namespace, rest: list[str]) -> None:
    """sft data RECIPE [--show N] [--json]"""
    import json

    from sft.datainfo import describe_data
    from sft.recipe import load_recipe

    stats, shown = describe_data(load_recipe(args.recipe, flags=rest), show=args.show, color=sys.stdout.isatty())
    print(json.dumps(stats.as_dict(), indent=2) if args.json else stats.table("Training data"))
    if shown:
        print(shown)


def run_eval(args: argparse.Namespace, rest: list[str]) -> None:
    """sft eval RECIPE [--key value ...]"""
    from sft.recipe import load_recipe
    from sft.training import evaluate

    metrics = evaluate(load_recipe(args.recipe, flags=rest))
    print("\n".join(f"{k:<28} {v:.6g}" if isinstance(v, float) else f"{k:<28} {v}" for k, v in metrics.items()))
