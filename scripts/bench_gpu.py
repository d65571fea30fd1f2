"""Issue 19: real model shapes (random init) through sft, trl.SFTTrainer and plain transformers.Trainer, each run in
a fresh process with the same data, steps, batch and seed. Reached through scripts/bench.py (--model or --suite).

    python scripts/bench.py --device cuda --model qwen2.5-0.5b --method full --max_length 2048 --packing on
    python scripts/bench.py --device cuda --suite issue19 --json $OUT/issue19.json   # the whole issue-19 set
    python scripts/bench.py --model tiny --method qlora --max_length 128 --rows 48 --steps 2 --batch 2  # CPU check

Shapes come from sft/models/architectures.py (`known_config`); the tokenizers from ../shared/fixtures/tokenizers. The
model has the config's embedding rows, as the published model has (Qwen2.5 pads its 151,665 tokens to 151,936);
`--vocab_rows tokenizer` cuts them to the tokenizer's size (what the runs of 2026-11-26 and 27 did: a head whose rows
are not a multiple of 8, read through sft's padded copy, sft.training.linear_cross_entropy.aligned_head). The result
says which (`vocab_size`, `config_vocab_size`).
"""

import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import FIXTURES, REPO, alpaca_rows, matmul_peak, model_flops

TOKENIZERS = FIXTURES / "tokenizers"
MODELS = {  # name: (key of sft's architecture table, tokenizer fixture)
    "tiny": ("qwen/qwen2.5-0.5b", "qwen2.5-coder-3b-instruct"),
    "qwen2.5-0.5b": ("qwen/qwen2.5-0.5b", "qwen2.5-coder-3b-instruct"),
    "qwen2.5-7b": ("qwen/qwen2.5-7b", "qwen2.5-coder-3b-instruct"),
    "llama-3.2-1b": ("meta-llama/llama-3.2-1b", "meta-llama-3-8b-instruct"),
    "llama-3.1-8b": ("meta-llama/llama-3.1-8b", "meta-llama-3-8b-instruct"),
}
# The CPU check's shape: the Qwen2.5 family shrunk (the real tokenizer's vocabulary is kept).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# A tool is a base and optional '-'-joined modifiers: "sft-varlen-compile" is sft with attn_implementation varlen and
# torch_compile; "trl-flex" is TRL with flex_attention. Ratios are `sft/<tool>` (below 1: the tool is faster than sft's
# default), and the best sft and trl runs of a job are compared as well.
BASES = ("sft", "trl", "plain", "sft_syncs")
MODIFIERS = {
    # sft runs sdpa and its chunked loss; varlen: torch's varlen_attn (CUDA only) on flattened packed rows; flex:
    # transformers' BlockMask from position_ids; liger: Liger's fused linear cross-entropy at the trained positions
    # (where Liger cannot run, a recorded failure); compile: each decoder block compiled in place; budget (with
    # compile): activation_memory_budget 0.8, elementwise ops recomputed in the backward instead of kept (0.67x
    # Liger's activations per layer, scripts/bench_activations.py; the same matmuls); autotune (with compile):
    # inductor benchmarks its Triton GEMM templates against cuBLAS per shape (max-autotune, without CUDA graphs), for
    # the 0.5B shape's hidden-896 GEMMs, which cuBLAS ran far below the peak (BENCHMARKS.md);
    # fusedloss: loss_kernel fused, the chunked loss's softmax and gradient compiled into fused kernels (auto's choice
    # on CUDA since the seventh session); eagerloss: loss_kernel chunked, the eager chunk step; blocking:
    # batches copied to the GPU with blocking copies (sft's default before the sixth session: the GPU idled while
    # the next batch was collated).
    "sft": {"varlen": {"attn_implementation": "varlen"}, "flex": {"attn_implementation": "flex_attention"},
            "liger": {"loss_kernel": "liger"}, "compile": {"torch_compile": True},
            "budget": {"activation_memory_budget": 0.8},
            "autotune": {"torch_compile_mode": "max-autotune-no-cudagraphs"},
            "fusedloss": {"loss_kernel": "fused"}, "eagerloss": {"loss_kernel": "chunked"},
            "blocking": {"accelerator_config": {"non_blocking": False}}},
    # trl on sdpa flattens each padding-free batch into one row, so sdpa gets one [T, T] block mask over the whole
    # batch (8 x 2048 tokens: 16,384^2, no block skipped); flex: transformers' BlockMask skips the blocks between
    # examples (TRL's best isolating attention where no flash-attn package is installed); compile: torch_compile.
    "trl": {"flex": {"attn_implementation": "flex_attention"}, "compile": {"torch_compile": True}},
}


def tool_settings(tool: str) -> tuple[str, dict]:
    """(base, settings) of a tool name; SystemExit naming the choices for an unknown base or modifier."""
    base, *modifiers = tool.split("-")
    known = MODIFIERS.get(base, {})
    settings = [known.get(m) for m in modifiers]
    attentions = [s["attn_implementation"] for s in settings if s and "attn_implementation" in s]
    needs_compile = bool({"budget", "autotune"} & set(modifiers)) and "compile" not in modifiers
    if (base not in BASES or None in settings or len(set(modifiers)) < len(modifiers) or len(attentions) > 1
            or needs_compile):
        choices = "; ".join(f"{b}-{'|'.join(m)}" for b, m in MODIFIERS.items())
        raise SystemExit(f"unknown tool {tool!r}: a base ({', '.join(BASES)}) and '-'-joined modifiers, each once "
                         f"and one attention at most; budget and autotune with compile ({choices})")
    return base, {key: value for setting in settings for key, value in setting.items()}


WARMUP = 2
# The adapter and 4-bit settings of the shipped 8B recipes (recipes/llama-3.1-8b-instruct/{lora,qlora}.yaml).
LORA = dict(r=16, alpha=32, dropout=0.05)


@dataclass
class Job:
    model: str
    method: str  # full | lora | qlora
    batch: int
    checkpointing: bool
    steps: int = 8
    tools: tuple[str, ...] = ("sft", "trl", "plain")  # in the order they run: a job's time may end before the last


# Full fine-tunes without checkpointing (they fit in 80 GB); the 8B jobs at the recipes' micro-batch 2 with
# checkpointing on, which the QLoRA 24 GB goal needs. Each job's tools: sft's fastest run and TRL's surest first (the
# issue's comparison), then the others, as far as the job's share goes. The order is measured (H100, BENCHMARKS.md):
# trl-flex did not reach the end of its first steps in 43-76 s (flex_attention compiling), so it runs last, after TRL
# on sdpa (first step 32-40 s); sft-varlen-compile was sft's fastest on Qwen2.5-0.5B (1.25x sft-varlen, first step
# 31 s), and leads the full jobs; the 8B jobs, whose share also builds and saves the model, lead with sft-varlen.
FULL_TOOLS = ("sft-varlen-compile", "trl", "sft-varlen", "plain", "trl-flex", "sft-varlen-compile-budget", "sft")
ADAPTER_TOOLS = ("sft-varlen", "trl", "sft-varlen-compile", "plain", "trl-flex", "sft")
SUITES = {
    "issue19-full": [Job("qwen2.5-0.5b", "full", 8, False, tools=FULL_TOOLS),
                     Job("llama-3.2-1b", "full", 8, False, tools=FULL_TOOLS)],
    "issue19-8b": [Job("llama-3.1-8b", "lora", 2, True, 6, ADAPTER_TOOLS),
                   Job("llama-3.1-8b", "qlora", 2, True, 6, ADAPTER_TOOLS)],
}
SUITES["issue19"] = SUITES["issue19-full"] + SUITES["issue19-8b"]


# ---- setup (parent process) ----

def build_model(model: str, device: str, folder: Path, vocab_rows: str = "config") -> dict:
    """Save the tokenizer and a seed-0 random model of the named shape (bf16 on GPU) into `folder`, with the config's
    embedding rows or (`vocab_rows` "tokenizer") the tokenizer's count where that is smaller."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO))
    from sft.models.architectures import known_config

    key, tokenizer_name = MODELS[model]
    # The Llama-3 fixture has only tokenizer.model (tiktoken format); converting it needs `tiktoken`, so it is done
    # once here and the workers load the saved tokenizer.json.
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS / tokenizer_name)
    config = known_config(key)
    for name, value in (TINY if model == "tiny" else {}).items():
        setattr(config, name, value)
    if getattr(config, "layer_types", None):  # per-layer attention types must match the (tiny) depth
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    config_vocab = config.vocab_size
    if vocab_rows == "tokenizer":
        config.vocab_size = min(config_vocab, len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: an 8B model on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    gc.collect()  # free the parent's copy before the workers need the GPU
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"architecture": key, "tokenizer": tokenizer_name, "vocab_size": config.vocab_size,
            "config_vocab_size": config_vocab}


# ---- one measured run (worker process) ----

def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (torch_compile; flex_attention compiles its kernel too)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def clock_callback(spec: dict, record: dict):
    """Trainer callback: wall time at the end of every optimizer step, the graphs compiled by the end of the
    warm-up, each step end appended to the run's progress file (what a run cut at its time limit had done), and with
    --profile a profiler over the steps after the timed ones.

    The GPU is synchronised only where a time is read: the first step's end (time to first step), the warm-up's,
    the timed steps' and the profiled steps'. A sync at every step would idle the GPU while the host fetches and
    collates the next batch (about 8 ms a step on 2 CPU cores at 8 x 2048 tokens), which a user's run, logging every
    few steps, does not; the other ends are the host's (the GPU at most a step behind)."""
    from transformers import TrainerCallback

    timed_end = WARMUP + spec["steps"]
    synchronised = {1, WARMUP, timed_end, timed_end + PROFILED}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if spec["device"] == "cuda" and len(record["ends"]) + 1 in synchronised:
                import torch
                torch.cuda.synchronize()
            record["ends"].append(time.time())
            with open(spec["progress"], "a") as progress:
                progress.write(f"{record['ends'][-1] - spec['t0']:.1f}\n")
            if len(record["ends"]) == WARMUP:
                record["graphs_at_warmup"] = compiled_graphs()
            if len(record["ends"]) == timed_end:
                record["graphs_at_timed_end"] = compiled_graphs()
                if spec.get("profile") or spec.get("trace"):
                    record["profiler"] = start_profiler(spec["device"], host_ops=bool(spec.get("trace")))
            if len(record["ends"]) == timed_end + PROFILED and "profiler" in record:
                seconds = record["ends"][-1] - record["ends"][timed_end - 1]
                profiler = record.pop("profiler")
                record["profile"] = kernel_breakdown(profiler, spec["device"], PROFILED, seconds)
                if spec.get("trace"):
                    record["profile"]["trace"] = save_trace(profiler, spec)

    return Clock()


# --profile: where a step's time goes, for the next change to aim at. Kernels are sorted by their names (cuBLAS's
# sm90_xmma/nvjet/cutlass GEMMs, flash attention, AdamW's multi-tensor kernels, copies); a Triton kernel (from
# torch.compile or Liger) is named by its Python function, a bare identifier, where CUDA C++ kernels carry `void` and
# namespaces. On CPU torch's operators stand in for kernels (a check that the path runs, not a profile to read).
PROFILED = 2  # steps profiled after the timed ones, so the profiler's overhead is never in tokens/s
# attention first: flash kernels' names carry cutlass types (H100, 2026-11-26: varlen's were counted as matmul)
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "varlen")),
                ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("copy/cast", ("copy", "cast", "memcpy", "memset", "fill")))


def kernel_kind(name: str) -> str:
    kind = next((kind for kind, marks in KERNEL_KINDS if any(mark in name.lower() for mark in marks)), None)
    return kind or ("triton" if name.isidentifier() else "other")


def start_profiler(device: str, host_ops: bool = False):
    """A profiler of the device's kernels; `host_ops` (--trace) also records torch's operators on the host, which
    scripts/trace_gaps.py needs to name what the host ran while the GPU waited (more profiler overhead)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    if host_ops and device == "cuda":
        activities.append(ProfilerActivity.CPU)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def save_trace(profiler, spec: dict) -> str:
    """--trace: the profiled steps' Chrome trace, gzipped, as <trace dir>/<model>-<method>-<tool>.json.gz (for
    scripts/trace_gaps.py, or chrome://tracing and Perfetto); returns its path."""
    import gzip
    import shutil

    folder = Path(spec["trace"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec['model']}-{spec['method']}-{spec['tool']}.json"
    profiler.export_chrome_trace(str(path))
    with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    path.unlink()
    return f"{path}.gz"


def kernel_breakdown(profiler, device: str, steps: int, seconds: float) -> dict:
    """Milliseconds per step by kind of kernel (self time), the busiest kernels, and the step's wall time not covered
    by kernels (`idle_ms`: the GPU waiting on the host: launches, Python, syncs)."""
    from torch.autograd import DeviceType

    profiler.stop()
    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    times = {}
    for event in profiler.key_averages():
        if event.device_type == kind and (device == "cuda" or event.key.startswith("aten::")):
            times[event.key] = (event.self_device_time_total if device == "cuda" else event.self_cpu_time_total) / 1e3
    per_kind = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["triton", "other"], 0.0)
    for name, ms in times.items():
        per_kind[kernel_kind(name)] += ms / steps
    busy = sum(per_kind.values())
    # 30, names to 140 characters: the Qwen2.5-0.5B head's sm75 `align1` GEMMs (61.5 of 122 ms of matmuls) showed in
    # the top 3, what sat below the top 12 (20.7 ms of "other") did not
    top = sorted(times.items(), key=lambda item: -item[1])[:30]
    return {"step_ms": 1e3 * seconds / steps, "kernel_ms": busy, "idle_ms": max(1e3 * seconds / steps - busy, 0.0),
            "by_kind_ms": per_kind, "top_kernels_ms": {name[:140]: ms / steps for name, ms in top}}


def example_lengths(inputs: dict) -> list[int]:
    """Example lengths in one micro-batch (host tensors): runs of restarting position ids (packed or padding-free
    rows), else the unpadded rows."""
    from sft.data.boundaries import spans

    mask, pos = inputs.get("attention_mask"), inputs.get("position_ids")
    if pos is None:
        return mask.sum(-1).tolist() if mask is not None else [inputs["input_ids"].shape[1]] * len(inputs["input_ids"])
    pos = pos[mask.bool()] if mask is not None else pos.flatten()
    return [end - start for start, end in spans(pos)]  # sft's one rule for where examples start


def count_batches(trainer, record: dict) -> None:
    """Keep every micro-batch the trainer trains on, and the loss training_step returns for it, for batch_counts and
    the step losses after training. They are GPU tensors here (accelerate moved the batch before training_step):
    reading them now would sync every micro-step of every tool (so would the Trainer's logging of every step's loss,
    which the runs leave to the end)."""
    original = trainer.training_step

    def counting(model, inputs, num_items_in_batch=None):
        keys = ("input_ids", "labels", "attention_mask", "position_ids")
        record["inputs"].append({k: inputs[k] for k in keys if k in inputs})
        loss = original(model, inputs, num_items_in_batch)
        record["loss_tensors"].append(loss.detach())
        return loss

    trainer.training_step = counting  # benchmark instrumentation only


def batch_counts(batch: dict) -> tuple[int, int, int]:
    """Tokens, trained tokens and causal query-key pairs of one kept micro-batch."""
    batch = {k: v.cpu() for k, v in batch.items()}
    lengths = example_lengths(batch)
    return sum(lengths), int((batch["labels"][:, 1:] != -100).sum()), sum(n * (n + 1) // 2 for n in lengths)


def common_args(spec: dict) -> dict:
    """TrainingArguments every tool shares: same batch, steps, optimizer, schedule and seed."""
    cuda = spec["device"] == "cuda"
    return {"output_dir": str(Path(spec["workdir"]) / f"out-{spec['method']}-{spec['tool']}"),
            "per_device_train_batch_size":
            spec["batch"], "max_steps": spec["steps"] + WARMUP + (PROFILED if spec.get("profile") else 0),
            "learning_rate": 1e-4, "lr_scheduler_type": "constant",
            "logging_steps": 1000, "save_strategy": "no", "report_to": "none", "seed": 0, "bf16": cuda,
            "use_cpu": not cuda}


def queued_copies(spec: dict) -> dict:
    """Batches copied to the GPU without waiting for it, as sft does by default (SFTConfig, pinned memory): given
    to TRL and the plain Trainer too, so that the comparison is not of that default (the `blocking` modifier is)."""
    return {"accelerator_config": {"non_blocking": True}} if spec["device"] == "cuda" else {}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear",
                      task_type="CAUSAL_LM")


def load_model(spec: dict):
    """The saved model as trl and plain Trainer users load it: bf16 (fp32 on CPU), 4-bit NF4 for QLoRA."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    kwargs = {"dtype": dtype, "attn_implementation": spec.get("settings", {}).get("attn_implementation", "sdpa")}
    if spec["method"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": 0 if spec["device"] == "cuda" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(Path(spec["workdir"]) / "model", **kwargs)
    model.config.use_cache = False
    return model


def sft_syncs_trainer(spec: dict, callback):
    """sft with host syncs per micro-step put back, to A/B their cost (`--tools sft,sft_syncs`): the chunked loss
    finds trained positions with nonzero (no host count), the Trainer's NaN filter reads each loss (twice) and
    DivergenceGuard reads each loss: 4 syncs per micro-step (sft before the fix had 6: a boolean-mask selection
    of two tensors and its backward instead of the one nonzero)."""
    from sft.data.collators import HostCount
    from sft.training.divergence import DivergenceGuard

    HostCount.__call__ = lambda self, features: self.collator(features)
    DivergenceGuard.add_loss = lambda self, loss: setattr(self, "_step_loss", self._step_loss + float(loss))
    return sft_trainer(spec, callback, {"logging_nan_inf_filter": True})


def sft_trainer(spec: dict, callback, extra: dict | None = None):
    """sft's recipe path: its packer, chunked loss, fused AdamW default, LoRA/QLoRA from recipe keys."""
    from sft.data.build import prepare_splits
    from sft.data.stats import compute_stats
    from sft.data.tokenizer import load_tokenizer
    from sft.models.loading import load_model as sft_load_model
    from sft.training.flows import apply_packing
    from sft.training.recipe import load_recipe
    from sft.training.trainer import SFTTrainer

    workdir, peft = Path(spec["workdir"]), spec["method"] != "full"
    recipe = common_args(spec) | {
        "model_name_or_path": str(workdir / "model"), "dataset": str(workdir / "data.jsonl"),
        "dataset_format": "prompt_completion", "max_length": spec["max_length"], "packing": spec["packing"],
        "dtype": "bfloat16" if spec["device"] == "cuda" else "float32",
        "attn_implementation": "sdpa",
        "activation_checkpointing": spec["checkpointing"], "use_peft": peft, "load_in_4bit": spec["method"] == "qlora"}
    if peft:
        recipe |= {"lora_r": LORA["r"], "lora_alpha": LORA["alpha"], "lora_dropout": LORA["dropout"]}
    settings = dict(spec.get("settings", {}))
    config = load_recipe(recipe | settings | (extra or {}))
    tokenizer = load_tokenizer(config)
    train, _ = prepare_splits(config, tokenizer)
    stats = compute_stats(train.dataset, config.max_length, train.dropped_rows, train.truncated_rows)
    dataset, _ = apply_packing(config, train.dataset, None, stats)
    return SFTTrainer(model=sft_load_model(config, tokenizer), args=config, processing_class=tokenizer,
                      train_dataset=dataset, callbacks=[callback])


def trl_trainer(spec: dict, callback):
    """TRL's best configuration: BFD packing, padding-free, Liger kernels where liger_kernel imports (GPU)."""
    import importlib.util

    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    workdir = Path(spec["workdir"])
    liger = spec["liger"] and spec["device"] == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    config = SFTConfig(**common_args(spec), **queued_copies(spec), max_length=spec["max_length"],
                       packing=spec["packing"], padding_free=spec["packing"], use_liger_kernel=liger,
                       gradient_checkpointing=spec["checkpointing"],
                       torch_compile=spec.get("settings", {}).get("torch_compile", False))
    data = datasets.load_dataset("json", data_files=str(workdir / "data.jsonl"), split="train")
    return SFTTrainer(model=load_model(spec), args=config, train_dataset=data,
                      processing_class=AutoTokenizer.from_pretrained(workdir / "model"),
                      peft_config=lora_config() if spec["method"] != "full" else None, callbacks=[callback])


def plain_trainer(spec: dict, callback):
    """transformers.Trainer as its docs teach: tokenized prompt + completion (prompt masked), padded batches."""
    from transformers import (
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    workdir = Path(spec["workdir"])
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    rows = [json.loads(line) for line in (workdir / "data.jsonl").read_text().splitlines()]
    prompts = tokenizer([r["prompt"] for r in rows])["input_ids"]
    answers = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    data = [{"input_ids": (p + a + [tokenizer.eos_token_id])[:spec["max_length"]],
             "labels": ([-100] * len(p) + a + [tokenizer.eos_token_id])[:spec["max_length"]]}
            for p, a in zip(prompts, answers)]
    model = load_model(spec)
    if spec["method"] != "full":
        from peft import get_peft_model, prepare_model_for_kbit_training

        if spec["method"] == "qlora":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["checkpointing"])
        elif spec["checkpointing"]:
            model.enable_input_require_grads()  # checkpointed frozen embeddings would otherwise cut the graph
        model = get_peft_model(model, lora_config())
    args = TrainingArguments(**common_args(spec), **queued_copies(spec), gradient_checkpointing=spec["checkpointing"])
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[callback],
                   data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))


def worker(spec: dict) -> dict:
    """One fresh-process run of one tool; time to first step counts from the parent's spawn of this process."""
    import torch

    sys.path.insert(0, str(REPO))
    record = {"ends": [], "inputs": [], "loss_tensors": []}
    base, spec["settings"] = tool_settings(spec["tool"])
    build = {"sft_syncs": sft_syncs_trainer, "trl": trl_trainer, "plain": plain_trainer}.get(base, sft_trainer)
    trainer = build(spec, clock_callback(spec, record))
    count_batches(trainer, record)
    trainer.train()
    record["batches"] = [batch_counts(b) for b in record.pop("inputs")]
    record["losses"] = [float(loss) for loss in record.pop("loss_tensors")]  # one micro-batch a step
    last = WARMUP + spec["steps"] - 1  # the timed steps' last end: profiled steps come after it
    ends, timed = record["ends"], record["batches"][WARMUP:last + 1]
    seconds = ends[last] - ends[WARMUP - 1]
    tokens, trained, pairs = (sum(b[i] for b in timed) for i in range(3))
    flops = model_flops(trainer.model.config, tokens, pairs, frozen=spec["method"] != "full")
    cuda = spec["device"] == "cuda"
    return {"tool": spec["tool"], "tokens_per_s": tokens / seconds, "trained_tokens_per_s": trained / seconds,
            "tokens_per_step": tokens / spec["steps"], "step_seconds": seconds / spec["steps"],
            "model_flops_per_s": flops / seconds, "time_to_first_step_s": ends[0] - spec["t0"],
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "final_loss": record["losses"][-1], "losses": record["losses"],
            "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "liger": bool(getattr(trainer.args, "use_liger_kernel", False)) or
            getattr(trainer.args, "loss_kernel", None) == "liger",
            "loss_kernel": getattr(getattr(trainer, "token_loss", None), "kernel", None),  # sft's only
            "attention": trainer.model.config._attn_implementation, "torch_compile": trainer.args.torch_compile,
            # graphs compiled during the timed steps (a new input shape or mask type): their compile time is in them
            "graphs_compiled_timed": record["graphs_at_timed_end"] - record["graphs_at_warmup"],
            "optim": getattr(trainer.args.optim, "value", trainer.args.optim)} | (
        {"profile": record["profile"]} if "profile" in record else {})


# ---- orchestration (parent process) ----

def spawn(spec: dict, timeout: float) -> dict:
    """Run one tool in a fresh process; a failure or time-out is recorded, not fatal, so the suite goes on. A run cut
    short says how far it got (its step ends, seconds from its spawn) and the end of what it printed."""
    progress = Path(spec["workdir"]) / f"progress-{spec['method']}-{spec['tool']}.txt"
    spec = dict(spec, t0=time.time(), progress=str(progress))
    command = [sys.executable, str(Path(__file__).with_name("bench.py")), "--gpu_worker", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired as cut:
        stderr = cut.stderr.decode(errors="replace") if isinstance(cut.stderr, bytes) else cut.stderr or ""
        ends = step_ends(progress)
        return {"tool": spec["tool"], "error": f"timed out after {timeout:.0f} s (suite budget), {len(ends)} of "
                f"{spec['steps'] + WARMUP} steps done", "step_ends_s": ends, "stderr_tail": stderr[-1500:]}
    if done.returncode != 0:
        return {"tool": spec["tool"], "error": done.stderr[-3000:], "step_ends_s": step_ends(progress)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_ends(progress: Path) -> list[float]:
    """Seconds from a run's spawn to each optimizer step it finished (its progress file)."""
    return [float(line) for line in progress.read_text().split()] if progress.exists() else []


def ratios(runs: dict, peak: float) -> dict:
    """MFU of each run, and sft's ratios to trl, plain and the sft variants (tokens/s, MFU, peak memory, time to
    first step)."""
    for run in runs.values():
        if "model_flops_per_s" in run:
            run["mfu"] = run["model_flops_per_s"] / peak
    out, sft = {}, runs.get("sft", {})
    for other in [tool for tool in runs if tool != "sft"]:
        base = runs.get(other, {})
        for key in ("tokens_per_s", "mfu", "peak_memory_bytes", "time_to_first_step_s"):
            if sft.get(key) and base.get(key):
                out[f"sft/{other} {key}"] = sft[key] / base[key]
    return out


def run_job(job: Job, args, root: Path, peak: float, deadline: float) -> dict:
    # one saved model per shape: the 8B LoRA and QLoRA jobs share its 16 GB
    workdir = root / (job.model + ("-tokenizer-rows" if args.vocab_rows == "tokenizer" else ""))
    if not (workdir / "model.json").exists():
        (workdir / "model").mkdir(parents=True)
        (workdir / "data.jsonl").write_text("\n".join(json.dumps(r) for r in alpaca_rows(args.rows)) + "\n")
        info = build_model(job.model, args.device, workdir / "model", args.vocab_rows)
        (workdir / "model.json").write_text(json.dumps(info))
    result = {"job": asdict(job), "model": json.loads((workdir / "model.json").read_text()), "runs": {}}
    spec = asdict(job) | {"workdir": str(workdir), "device": args.device, "max_length": args.max_length,
                          "packing": args.packing != "off", "liger": args.liger == "auto",
                          "profile": args.profile, "trace": args.trace}
    for tool in args.tools.split(",") if args.tools else job.tools:
        if "varlen" in tool.split("-") and args.device != "cuda":
            result["runs"][tool] = {"tool": tool, "error": "skipped: varlen_attn runs on CUDA only"}
        else:
            result["runs"][tool] = spawn(spec | {"tool": tool}, deadline - time.time())
        print(f"  {job.model} {job.method} {tool}: {result['runs'][tool].get('tokens_per_s', 'failed')}",
              file=sys.stderr)
    result["ratios"] = ratios(result["runs"], peak)
    result["best"] = best_against_best(result["runs"])
    return result


def fastest(runs: dict, base: str) -> str | None:
    """The finished run of `base` (any modifiers) with the most tokens/s."""
    done = [tool for tool, run in runs.items() if tool.split("-")[0] == base and "tokens_per_s" in run]
    return max(done, key=lambda tool: runs[tool]["tokens_per_s"], default=None)


def best_against_best(runs: dict) -> dict:
    """The issue's comparison: sft's fastest run against TRL's fastest (tokens/s, peak memory, MFU)."""
    sft, trl = fastest(runs, "sft"), fastest(runs, "trl")
    if not (sft and trl):
        return {}
    return {"sft": sft, "trl": trl, "sft_mfu": runs[sft]["mfu"],
            "tokens_per_s": runs[sft]["tokens_per_s"] / runs[trl]["tokens_per_s"],
            "peak_memory_bytes": runs[sft]["peak_memory_bytes"] / runs[trl]["peak_memory_bytes"]}


def table(results: dict) -> str:
    width = max([11] + [len(tool) + 2 for job in results["jobs"] for tool in job.get("runs", {})])
    lines = [f"matmul peak measured (bf16 on GPU, fp32 on CPU): {results['peak_flops'] / 1e12:.2f} TFLOP/s "
             f"({results['device_name']}); peak GB: torch.cuda.max_memory_allocated (CPU: process peak RSS)",
             f"{'model':<14}{'method':<7}{'tool':<{width}}{'tokens/s':>11}{'MFU':>7}{'peak GB':>9}{'1st step s':>11}"
             f"{'loss':>8}  sft/tool tok/s", "-" * (84 + width)]
    for job in results["jobs"]:
        if "skipped" in job:
            lines.append(f"{job['job']['model']:<14}{job['job']['method']:<7}skipped: {job['skipped']}")
        for tool, run in job.get("runs", {}).items():
            head = f"{job['job']['model']:<14}{job['job']['method']:<7}{tool:<{width}}"
            if "error" in run:
                lines.append(head + "failed: " + error_line(run["error"])[:60])
                continue
            memory = run["peak_memory_bytes"] / 1e9
            ratio = job["ratios"].get(f"sft/{tool} tokens_per_s")
            lines.append(head + f"{run['tokens_per_s']:>11,.0f}{run['mfu']:>7.1%}{memory:>9.2f}"
                         f"{run['time_to_first_step_s']:>11.1f}{run['final_loss']:>8.3f}"
                         + (f"  {ratio:.2f}x" if ratio else "")
                         + (f"  ({run['graphs_compiled_timed']} graphs compiled in the timed steps)"
                            if run.get("graphs_compiled_timed") else ""))
        lines += profile_lines(job)
        if job.get("best"):
            best = job["best"]
            lines.append(f"{'':<21}best sft ({best['sft']}) / best trl ({best['trl']}): {best['tokens_per_s']:.2f}x "
                         f"tokens/s, {best['peak_memory_bytes']:.2f}x peak memory; sft MFU {best['sft_mfu']:.1%}")
    return "\n".join(lines)


def profile_lines(job: dict) -> list[str]:
    """--profile: each run's step split by kind of kernel (ms per step), and its busiest kernel."""
    lines = []
    for tool, run in job.get("runs", {}).items():
        if "profile" in run:
            prof = run["profile"]
            kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in prof["by_kind_ms"].items() if ms >= 0.05)
            busiest = next(iter(prof["top_kernels_ms"].items()), ("-", 0.0))
            lines.append(f"{'':<21}profile {tool}: step {prof['step_ms']:.1f} ms = kernels {prof['kernel_ms']:.1f} "
                         f"({kinds}) + idle {prof['idle_ms']:.1f}; busiest: {busiest[0][:50]} {busiest[1]:.1f} ms")
    return lines


def error_line(stderr: str) -> str:
    """The exception line of a failed run's stderr (a progress bar may come after it), else its last line."""
    lines = stderr.strip().splitlines() or [""]
    return next((line for line in reversed(lines) if "Error:" in line or "Exception:" in line), lines[-1])


def main(args) -> None:
    import torch

    start = time.time()
    jobs = SUITES[args.suite] if args.suite else [Job(args.model, args.method, args.batch, args.checkpointing == "on",
                                                      args.steps)]
    for tool in args.tools.split(",") if args.tools else {t for job in jobs for t in job.tools}:
        tool_settings(tool)  # a misspelt tool fails here, not after minutes of building models
    results = {"setup": {k: v for k, v in vars(args).items() if k != "gpu_worker"}, "jobs": [],
               "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "versions": versions(), "peak_flops": matmul_peak(args.device)}
    with tempfile.TemporaryDirectory(prefix="sft-bench-gpu-") as tmp:
        for index, job in enumerate(jobs):
            deadline = job_deadline(start + args.budget_s, time.time(), len(jobs) - index)
            if deadline <= time.time():  # no time left: do not build (and save) another model
                results["jobs"].append({"job": asdict(job), "skipped": "suite budget spent"})
            else:
                results["jobs"].append(run_job(job, args, Path(tmp), results["peak_flops"], deadline))
            if args.json:  # after every job: a device call cut short still returns what was measured
                Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(table(results))


def job_deadline(suite_deadline: float, now: float, jobs_left: int) -> float:
    """When this job's runs must end: an equal share of the time left, so one slow job (an 8B model's save, a
    compile) cannot leave the jobs after it unmeasured; a job that ends early leaves its time to the others."""
    return now + max(suite_deadline - now, 0) / jobs_left


def versions() -> dict:
    import importlib.metadata as meta

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "liger-kernel", "datasets"):
        try:
            found[name] = meta.version(name)
        except meta.PackageNotFoundError:
            found[name] = None
    return found
