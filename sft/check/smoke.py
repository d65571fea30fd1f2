"""`sft check RECIPE`: prove a recipe sound in seconds on CPU, on a tiny model of the same architecture.

Every key is validated, the data format is checked on a sample (the real data when reachable, else the project's
sample data of the declared format), and the recipe's settings (packing, LoRA/QLoRA, NEFTune, chat template,
generation eval, ...) run for 2 training steps and a short eval. GPU-only settings are reported and skipped, and
so are multi-process ones (distributed presets, fsdp, deepspeed), with how `sft train` needs them launched.
"""

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from sft.config.arguments import SFTConfig
from sft.data.sources import Source, all_local, parse_sources
from sft.errors import SFTError
from sft.evaluation.metrics import check_best_metric
from sft.models.families import NON_TEXT_CONFIGS, VARLEN, guess_model_type
from sft.models.hub import local_files_only
from sft.models.loading import (
    attention_on_a_gpu,
    check_varlen,
    generation_eos,
    recipe_architecture,
    tokenizer_mismatch,
)
from sft.training.catalog import shipped
from sft.training.flows import fitted_max_length
from sft.training.loss import loss_on_a_gpu
from sft.training.presets import shards
from sft.training.recipe import load_recipe

log = logging.getLogger(__name__)
DATA = shipped("data")
EMBEDDED_TOKENIZER = DATA / "models" / "tiny-llama"
SAMPLE_ROWS = 64  # enough for 2 steps and a short eval; keeps the check to seconds
SAMPLES = {"messages": "chat_sample.jsonl", "alpaca": "alpaca_sample.json", "seq2seq": "seq2seq_sample.jsonl",
           "text": "alpaca_sample.json", "prompt_completion": "alpaca_sample.json"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
            n_embd=64, n_layer=2, n_head=4, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, head_dim=16)
# The smoke run keeps the recipe's max_length, and the tiny stand-in gets as many positions (at least TINY's): a cap at
# the stand-in's 1024 positions dropped every row with a longer prompt (a long system prompt or tool list before the
# first answer) and failed a recipe at 4096 that `sft train` runs. Positions cost nothing for rotary families and a
# max_length x 64 table for learned ones; the run's cost is the sample rows' own lengths (padded to the longest row of
# a batch, the LM head only at trained positions), so short data costs the same under any max_length.
GPU_ONLY = {"bf16": False, "tf32": None, "fp16": False, "bf16_full_eval": False}
# The smoke run is one plain process, on CPU or GPU: sharding needs a launcher (sft launch), and `--prove` trains
# the recipe's preset on 2 processes under torchrun.
MULTI_PROCESS = {"distributed": None, "fsdp": "", "fsdp_config": None, "deepspeed": None}


@dataclasses.dataclass
class CheckReport:
    """What `sft check` did and found."""

    recipe: str
    model_type: str = ""
    data: str = ""
    skipped: list[str] = dataclasses.field(default_factory=list)
    launch: str = ""  # the multi-process keys skipped, and how the recipe must be started
    metrics: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    warnings: list[str] = dataclasses.field(default_factory=list)  # what sft train warned of in the smoke run
    gpu_attention: str = ""  # the attention the recipe's run gets on a GPU (the smoke run's is sdpa)
    gpu_loss: str = ""  # what computes its training loss on a GPU (the smoke run's: the eager chunk step)

    def table(self) -> str:
        rows = [("recipe", self.recipe), ("architecture", f"tiny {self.model_type} (2 layers, hidden 64)"),
                ("data", self.data), ("skipped (GPU only)", ", ".join(self.skipped) or "-")]
        rows += [("skipped (multi-process)", self.launch)] if self.launch else []
        rows += [("attention on a GPU", self.gpu_attention)] if self.gpu_attention else []
        rows += [("loss on a GPU", self.gpu_loss)] if self.gpu_loss else []
        rows += [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in self.metrics.items()]
        rows.append(("time", f"{self.seconds:.1f} s"))
        width = max(len(k) for k, _ in rows)
        table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
        if not self.warnings:
            return table + "\nOK: the recipe is sound."
        # a run that trains to exit 0 and still wastes itself (most answers cut, ...): the check is not a plain OK
        return "\n".join([table, *(f"WARNING: {w}" for w in self.warnings),
                          f"OK: the recipe runs, with {len(self.warnings)} warning(s) above."])


def check_recipe(path: str, flags: list[str] | None = None) -> CheckReport:
    """Validate and dry-run a recipe on CPU; raises SFTError with what is wrong."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sft-check-") as tmp:
        config, values, report = tiny_recipe(path, flags, Path(tmp))
        from sft.training.flows import train

        with warnings_of_sft(report.warnings):
            run_dir = train(load_recipe(values))
        report.metrics = _final_metrics(run_dir)
    # sft train checked metric_for_best_model against a user metric function's keys on a trial call; the smoke's
    # evaluation ran it on real predictions, whose keys may differ
    reported = [key.removeprefix("eval_") for key in report.metrics if key.startswith("eval_")]
    if reported:
        check_best_metric(config.metric_for_best_model, reported, config.predict_with_generate)
    report.seconds = time.perf_counter() - start
    return report


@contextlib.contextmanager
def warnings_of_sft(found: list[str]) -> Iterator[None]:
    """Collect into `found` the warnings sft logs meanwhile (sft train's on the recipe's data and schedule), which
    the check's log showed above a table ending "OK: the recipe is sound."."""
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: found.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("sft")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def tiny_recipe(path: str, flags: list[str] | None, folder: Path) -> tuple[SFTConfig, dict, CheckReport]:
    """The recipe as written, its values for a short CPU run on a tiny model of its architecture (saved under
    `folder`) and its sample data, and the report of what was replaced or skipped."""
    config = load_recipe(path, flags=flags)
    unset_hf_deepspeed_config()  # validating a ZeRO-3 recipe sets a global that would partition the tiny model
    real = real_architecture(config)
    if real is not None:  # the tiny stand-in has positions of its own: the real model must have max_length
        fitted_max_length(config, real)
        check_varlen(config, real)  # as sft train does: its smoke run swaps varlen for sdpa
    report = CheckReport(recipe=str(path), gpu_attention=attention_on_a_gpu(config, real) if real else "",
                         gpu_loss=loss_on_a_gpu(config, real) if real else "")
    overrides = cpu_overrides(config, report, folder)
    overrides.update(sample_data(config, report))
    overrides.update(tiny_model(config, report, folder / "model", real))
    return config, {**{k: getattr(config, k) for k in config.recipe_keys}, **overrides}, report


def real_architecture(config: SFTConfig) -> PretrainedConfig | None:
    """The recipe model's config where it is reachable here (a local folder, the HF cache, sft's built-in table, the
    Hub when online), else None: `sft train` checks what depends on it when it reads the config."""
    try:
        return recipe_architecture(config)
    except SFTError:
        return None


def cpu_overrides(config: SFTConfig, report: CheckReport, tmp: Path) -> dict:
    """Short-run settings, and GPU-only keys turned off (and reported) on a machine without CUDA."""
    overrides = {"output_dir": str(tmp / "run"), "max_steps": 2, "num_train_epochs": 1, "logging_steps": 1,
                 "save_strategy": "no", "eval_strategy": "no", "report_to": "none", "dtype": "float32",
                 # what needs evaluations during training, which the 2-step run does not make (refused without them)
                 "load_best_model_at_end": False, "early_stopping_patience": None,
                 "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 1,
                 "max_length": config.max_length, "dataloader_num_workers": 0, "overwrite_output_dir": True,
                 "bnb_4bit_compute_dtype": "float32", "push_to_hub": False,
                 # the recipe's warmup is for its real run's length, not the 2 steps (sft train warns of one too long)
                 "warmup_steps": 0}
    attn = config.attn_implementation or ""
    if attn.startswith("flash") or attn == VARLEN:  # half-precision GPU kernels; the smoke run is fp32, maybe on CPU
        report.skipped.append(f"attn_implementation={attn}")
        overrides["attn_implementation"] = "sdpa"
    overrides.update(single_process(config, report))
    if not torch.cuda.is_available():
        for key, off in GPU_ONLY.items():
            if getattr(config, key) not in (None, False, "", [], {}):
                report.skipped.append(key)
                overrides[key] = off
        if config.loss_kernel == "liger":  # Liger's kernels are Triton (CUDA); sft's own computes the same loss
            report.skipped.append("loss_kernel=liger")
            overrides["loss_kernel"] = "auto"
    return overrides


def single_process(config: SFTConfig, report: CheckReport) -> dict:
    """The multi-process keys turned off for the one-process smoke run, reported with how `sft train` takes them."""
    keys = [key for key in MULTI_PROCESS if getattr(config, key) not in (None, False, "", [], {})]
    if not keys:
        return {}
    start = f"sft launch {report.recipe} --num_processes N"
    report.launch = ", ".join(keys) + (f": train with `{start}` (N GPUs; 1 on one GPU), plain `sft train` refuses "
                                       "a sharded run" if shards(config) else f": `{start}` runs one per GPU")
    return {key: MULTI_PROCESS[key] for key in keys}


def sample_data(config: SFTConfig, report: CheckReport) -> dict:
    """The recipe's own data when it is a local file, else the project's sample data of the declared format."""
    sources = parse_sources(config.dataset)
    evaluation = parse_sources(config.eval_dataset, "eval_dataset") if config.eval_dataset is not None else []
    local_evaluation = all_local(evaluation)  # first: a typo in either path is an error, not "out of reach"
    if all_local(sources):
        report.data = f"the recipe's own data (first {SAMPLE_ROWS} rows of each source)"
        held_out = {"eval_dataset": None, "eval_split_size": 8}
        # A local eval_dataset is sampled too: replaced by held-out training rows, a file that `sft train` refuses
        # (a format it cannot tell, a `columns` key it lacks) passed the check, and one in another format than the
        # training data was never rendered.
        if evaluation and local_evaluation:
            report.data += ", eval_dataset too"
            held_out = {"eval_dataset": [_sample(s) for s in evaluation]}
        return {"dataset": [_sample(s) for s in sources], **held_out}
    fmt = config.dataset_format if config.dataset_format != "auto" else guess_format(config)
    report.data = f"sample {fmt} data ({SAMPLES[fmt]}); the recipe's data is not reachable here"
    sample = [{"path": str(DATA / SAMPLES[fmt]), "split": f"train[:{SAMPLE_ROWS}]"}]
    return {"dataset": sample, "eval_dataset": None, "eval_split_size": 8, "dataset_format": fmt}


def _sample(source: Source) -> dict:
    """A local source's first SAMPLE_ROWS rows, with its column mapping."""
    # "train[:64]" samples as "train[:8]": datasets cannot slice a slice
    return {"path": source.path, "split": f"{source.split.split('[')[0]}[:{SAMPLE_ROWS}]", "columns": source.columns}


def guess_format(config: SFTConfig) -> str:
    """The format a recipe implies when it says `auto` and its data is out of reach."""
    return "messages" if config.chat_template else "alpaca"


def tiny_model(config: SFTConfig, report: CheckReport, folder: Path, real: PretrainedConfig | None = None) -> dict:
    """Save a 2-layer model of the recipe's architecture with a local tokenizer; returns recipe overrides. `real`:
    the recipe model's config, when known, whose vocabulary the tokenizer must fit."""
    report.model_type = guess_model_type(config.model_name_or_path)
    tokenizer = local_tokenizer(config)
    # The stand-in is sized to the tokenizer, so `sft train`'s warning for another family's tokenizer never fires
    # here; the embedded tokenizer stands in for one out of reach and fits no real model.
    own = Path(tokenizer.name_or_path).resolve() != EMBEDDED_TOKENIZER.resolve()
    rows = real.get_text_config().vocab_size if real is not None else None  # a multimodal config's text model's
    problem = tokenizer_mismatch(len(tokenizer), rows) if rows is not None and own else None
    if problem:
        raise SFTError(f"The tokenizer {config.tokenizer_name_or_path or config.model_name_or_path} does not fit the "
                       f"model {config.model_name_or_path}: {problem} (`sft train` would only warn and train on.)")
    tiny_config = tiny_architecture(report.model_type, len(tokenizer), config.max_length)
    # The architecture's default config names its own bos/eos ids (Llama's 1 and 2), which the saved generation config
    # copies: on Llama-3's tokenizer id 2 is '#', and every check of a Llama recipe with its real tokenizer and an
    # unreachable model failed as "the tokenizer is not this model's". The stand-in uses its tokenizer's ids.
    tiny_config.pad_token_id = tokenizer.pad_token_id
    if real is not None:  # Qwen2.5-0.5B ties its head to its embeddings, the architecture's default config does not
        tiny_config.tie_word_embeddings = real.tie_word_embeddings
    tiny_config.bos_token_id, tiny_config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    if tiny_config.is_encoder_decoder:  # T5/BART configs made from scratch name no decoder start token
        tiny_config.decoder_start_token_id = tokenizer.pad_token_id
    auto = AutoModelForSeq2SeqLM if tiny_config.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(tiny_config)
    eos = generation_eos(config.model_name_or_path)
    if eos is not None:  # the recipe model's stop tokens end chat turns (GLM's <|observation|>), not the default's
        model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    if not own and config.chat_template:  # the embedded template is not the real tokenizer's, which the preset replaces
        tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    return {"model_name_or_path": str(folder), "tokenizer_name_or_path": None, "revision": None,
            "trust_remote_code": False}


def local_tokenizer(config: SFTConfig):
    """The recipe's tokenizer when it is on this machine (or cached), else the embedded tiny model's."""
    for name in (config.tokenizer_name_or_path, config.model_name_or_path):
        if not name:
            continue
        try:
            return AutoTokenizer.from_pretrained(name, revision=config.revision,
                                                 local_files_only=local_files_only(name))
        except (OSError, ValueError):
            continue
    if not (EMBEDDED_TOKENIZER / "tokenizer.json").exists():
        raise SFTError(f"sft check needs a local tokenizer: none for the recipe, and {EMBEDDED_TOKENIZER} is missing "
                       "(rebuild it with scripts/make_tiny_model.py).")
    return AutoTokenizer.from_pretrained(EMBEDDED_TOKENIZER)


def tiny_architecture(model_type: str, vocab: int, max_length: int = 0) -> PretrainedConfig:
    """A 2-layer config of `model_type` over `vocab` tokens, with positions for `max_length` tokens (at least TINY's).
    A multimodal one (Gemma-3 4B+: a text model and a vision tower, each a sub-config) gets a tiny text model and tiny
    towers: the size fields at its top level are none of theirs, and the stand-in was built at full size (and failed
    first on the config's missing vocab_size)."""
    default = AutoConfig.for_model(model_type)
    subs = {key: getattr(default, key) for key in ("text_config", *NON_TEXT_CONFIGS)
            if isinstance(getattr(default, key, None), PretrainedConfig)}
    positions = max(TINY["max_position_embeddings"], max_length)
    if "text_config" not in subs:
        return AutoConfig.for_model(model_type, vocab_size=vocab, **_tiny_fields(model_type, positions))
    sizes = {key: _tiny_fields(sub.model_type) for key, sub in subs.items()}
    sizes["text_config"] |= {"vocab_size": vocab, **_tiny_fields(subs["text_config"].model_type, positions)}
    return AutoConfig.for_model(model_type, **sizes)


def _tiny_fields(model_type: str, positions: int | None = None) -> dict:
    """The TINY size fields that this architecture's config class knows, with `positions` when given; GPT-2 and its
    kin name their positions otherwise (n_positions, through the config's attribute_map)."""
    default = AutoConfig.for_model(model_type)
    known = default.to_dict()
    fields = {k: v for k, v in TINY.items() if k in known}
    name = default.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    if positions is not None and name in known:
        fields.pop("max_position_embeddings", None)
        fields[name] = positions
    return fields


def _final_metrics(run_dir: Path) -> dict:
    import json

    results = run_dir / "all_results.json"
    metrics = json.loads(results.read_text()) if results.exists() else {}
    return {k: v for k, v in metrics.items() if k in ("train_loss", "eval_loss") or k.startswith("eval_")}
