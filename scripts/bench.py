"""Side-by-side SFT benchmark: the same job through sft and through trl.SFTTrainer, each in a fresh process.

Default setup (issue #10): ../shared/fixtures/alpaca/alpaca_data_1k.json replicated to 20,000 rows, the
mistral-7b-instruct-v0.3 tokenizer, a tiny Mistral (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 32768,
random init, seed 0), max_length 512, batch 8, prompt/completion rows with the Stanford Alpaca templates.
Without ../shared it falls back to the project's data/alpaca_sample.json and the embedded tokenizer.

    python scripts/bench.py                       # packed and unpacked, 3 repeats, table
    python scripts/bench.py --packing on --repeats 1 --steps 6 --json results.json
    python scripts/bench.py --device cuda          # on a GPU: bf16, MFU against the GPU's bf16 peak

Real model shapes through sft, trl and plain transformers.Trainer (issue 19, --model or --suite): see
scripts/bench_gpu.py.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("SFT_FIXTURES", REPO.parent / "shared" / "fixtures"))  # as tests/conftest.py
ALPACA = FIXTURES / "alpaca" / "alpaca_data_1k.json"
TOKENIZER = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.3"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000, help="rows after replication (default 20000)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps timed per run (after 2 warm-up steps)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--packing", choices=("on", "off", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool and setting; the median is reported")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--chat", action="store_true", help="only time chat tokenization (render + encode) of the "
                        "real ShareGPT and tool-call fixtures with the Qwen2.5 tokenizer")
    gpu = parser.add_argument_group("real model shapes, three tools (scripts/bench_gpu.py)")
    gpu.add_argument("--model", choices=("tiny", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"))
    gpu.add_argument("--method", choices=("full", "lora", "qlora"), default="full")
    gpu.add_argument("--checkpointing", choices=("on", "off"), default="off", help="gradient checkpointing, all tools")
    gpu.add_argument("--tools", help="default: sft,trl,plain for --model, each job's own list for --suite (its "
                     "likeliest-fastest runs first). Comma-separated: a base (sft, trl, plain, sft_syncs: "
                     "sft with 4 host syncs per micro-step put back) and '-'-joined modifiers: sft-varlen|flex|liger|"
                     "compile|budget|autotune|fusedloss|eagerloss (attn_implementation varlen, CUDA only, or "
                     "flex_attention; Liger's fused linear cross-entropy; torch_compile; with compile: "
                     "activation_memory_budget 0.8, torch_compile_mode max-autotune-no-cudagraphs; loss_kernel fused "
                     "(auto's choice on CUDA) or chunked), trl-flex|compile; "
                     "e.g. sft-varlen-compile-budget,trl-flex")
    gpu.add_argument("--liger", choices=("auto", "off"), default="auto", help="trl: use_liger_kernel where it imports")
    gpu.add_argument("--vocab_rows", choices=("config", "tokenizer"), default="config",
                     help="embedding rows: the config's, as published (default), or the tokenizer's count where "
                     "smaller (Qwen2.5: 151,665 of 151,936; a head not 16-byte aligned, which sft pads)")
    gpu.add_argument("--profile", action="store_true", help="profile 2 more steps after the timed ones (not in "
                     "tokens/s): each run's step split into matmul, attention, optimizer, Triton, copy and other "
                     "kernels, the time no kernel ran, and the busiest kernels (JSON: runs[tool].profile)")
    gpu.add_argument("--trace", metavar="DIR", help="with the profile, save each run's profiled steps as a gzipped "
                     "Chrome trace in DIR, host operators included (scripts/trace_gaps.py: where the GPU waited)")
    gpu.add_argument("--suite", choices=("issue19", "issue19-full", "issue19-8b"), help="a fixed set of jobs")
    gpu.add_argument("--budget_s", type=float, default=540, help="seconds for the whole suite; each job gets an equal share of what is "
                     "left (a job that ends early leaves its time to the next); runs not finished in their job's share "
                     "are recorded as timed out")
    parser.add_argument("--gpu_worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("sft", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace:  # a trace is of the profiled steps
        args.profile, args.trace = True, str(Path(args.trace).resolve())
    return args


# ---- setup shared by both tools (parent process) ----

def alpaca_rows(count: int) -> list[dict]:
    """Prompt/completion rows with the Stanford Alpaca templates, replicated to `count` rows."""
    sys.path.insert(0, str(REPO))
    from sft.data.formats import ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT

    source = ALPACA if ALPACA.exists() else REPO / "data" / "alpaca_sample.json"
    base = json.loads(source.read_text())
    rows = []
    for i in range(count):
        row = base[i % len(base)]
        template = ALPACA_PROMPT_INPUT if row.get("input") else ALPACA_PROMPT_NO_INPUT
        rows.append({"prompt": template.format_map(row), "completion": row["output"]})
    return rows


def make_workdir(args: argparse.Namespace, workdir: Path) -> None:
    """Data file, tokenizer and the tiny Mistral (seed 0) that every run shares."""
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    rows = alpaca_rows(args.rows)
    (workdir / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER if TOKENIZER.exists() else REPO / "data/models/tiny-llama")
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id)
    MistralForCausalLM(config).save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")


def matmul_peak(device: str) -> float:
    """FLOP/s of a large fp32 (CPU) or bf16 (GPU) matmul on this machine, measured now."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 4096 if device == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 50 if device == "cuda" else 5
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


# ---- one measured run (worker process) ----

class StepTimer:
    """Trainer callback: per-step wall times and losses, tokens seen and trained."""

    def __init__(self, warmup: int) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step > warmup:
                    timer.times.append(time.perf_counter() - timer.start)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    timer.losses.append(float(logs["loss"]))

        self.callback, self.times, self.losses, self.start, self.warmup = Callback(), [], [], 0.0, warmup


def count_tokens(trainer, counts: list) -> None:
    """Record (non-padding, trained) tokens of every micro-batch the trainer really trains on (packed rows without
    the padding PackedCollator adds, as sft's logs count them)."""
    sys.path.insert(0, str(REPO))
    from sft.training.throughput import packed_padding

    original = trainer.training_step
    pad_id = getattr(trainer.processing_class, "pad_token_id", None)

    def counting(model, inputs, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        seen = (int(mask.sum()) if mask is not None
                else int(inputs["input_ids"].numel() - packed_padding(inputs, pad_id)))
        counts.append((seen, int((inputs["labels"][:, 1:] != -100).sum())))
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = counting  # benchmark instrumentation only


def run_sft(args: argparse.Namespace, workdir: Path, timer: StepTimer) -> dict:
    sys.path.insert(0, str(REPO))
    from sft.data.build import prepare_splits
    from sft.data.stats import compute_stats
    from sft.data.tokenizer import load_tokenizer
    from sft.models.loading import load_model
    from sft.training.flows import apply_packing
    from sft.training.recipe import load_recipe
    from sft.training.trainer import SFTTrainer

    config = load_recipe(common_recipe(args, workdir) | {"dataset_format": "prompt_completion",
                                                         "packing": args.packing == "on", "dtype": dtype(args)})
    tokenizer = load_tokenizer(config)
    start = time.perf_counter()
    train, _ = prepare_splits(config, tokenizer)
    stats = compute_stats(train.dataset, config.max_length, train.dropped_rows, train.truncated_rows)
    dataset, _ = apply_packing(config, train.dataset, None, stats)
    prep = time.perf_counter() - start
    trainer = SFTTrainer(model=load_model(config, tokenizer), args=config, processing_class=tokenizer,
                         train_dataset=dataset, callbacks=[timer.callback])
    return {"prep_seconds": prep, "efficiency": stats.packing_efficiency, "trainer": trainer}


def run_trl(args: argparse.Namespace, workdir: Path, timer: StepTimer) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    recipe = common_recipe(args, workdir)
    for key in ("model_name_or_path", "dataset", "dtype"):
        recipe.pop(key, None)
    config = SFTConfig(**recipe, packing=args.packing == "on", bf16=args.device == "cuda",
                       use_cpu=args.device == "cpu")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=dtype(args))
    data = datasets.load_dataset("json", data_files=str(workdir / "data.jsonl"), split="train")
    start = time.perf_counter()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         callbacks=[timer.callback])
    prep = time.perf_counter() - start
    lengths = trainer.train_dataset["input_ids"] if args.packing == "on" else None
    efficiency = (sum(map(len, lengths)) / (len(lengths) * args.max_length)) if lengths is not None else None
    return {"prep_seconds": prep, "efficiency": efficiency, "trainer": trainer}


def common_recipe(args: argparse.Namespace, workdir: Path) -> dict:
    """Settings both tools share: same data, lengths, batch, steps, optimizer and seed."""
    return {"model_name_or_path": str(workdir / "model"), "dataset": str(workdir / "data.jsonl"),
            "output_dir": str(workdir / f"out-{args.worker}-{os.getpid()}"), "max_length": args.max_length,
            "per_device_train_batch_size": args.batch, "max_steps": args.steps + 2, "learning_rate": 1e-4,
            "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "seed": 0, "dataloader_num_workers": 0, "dtype": dtype(args)}


def dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.device == "cuda" else "float32"


def worker(args: argparse.Namespace) -> dict:
    """One fresh-process run of one tool: preprocessing, then timed training steps."""
    import torch

    os.environ["HF_DATASETS_CACHE"] = args.cache
    workdir, warmup = Path(args.workdir), 2
    timer = StepTimer(warmup)
    run = (run_sft if args.worker == "sft" else run_trl)(args, workdir, timer)
    trainer, counts = run.pop("trainer"), []
    count_tokens(trainer, counts)
    trainer.train()
    seen, trained = (sum(c[i] for c in counts[warmup:]) for i in (0, 1))
    step = statistics.median(timer.times)
    params = sum(p.numel() for p in trainer.model.parameters())
    peak_mem = (torch.cuda.max_memory_allocated() if args.device == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"tool": args.worker, "packing": args.packing, "rows": args.rows, "prep_seconds": run["prep_seconds"],
            "prep_rows_per_s": args.rows / run["prep_seconds"], "packing_efficiency": run["efficiency"],
            "step_seconds": step, "tokens_per_s": seen / sum(timer.times), "trained_tokens_per_s":
            trained / sum(timer.times), "tokens_per_step": seen / args.steps, "peak_memory_bytes": peak_mem,
            "losses": timer.losses, "final_loss": timer.losses[-1], "params": params,
            "model_flops_per_step": model_flops(trainer.model.config, seen / args.steps)}


def model_flops(config, tokens: float, attention_pairs: float = 0, frozen: bool = False) -> float:
    """Training FLOPs of forward+backward over `tokens` tokens: 6 x matmul params per token (4 x for a frozen base
    under LoRA: no weight gradients; the adapter's <1% is not counted), plus attention: QK^T and AV cost 4 x
    (heads x head_dim) FLOPs per causal query-key pair and layer forward, x3 with the backward.
    `attention_pairs` = sum of n(n+1)/2 over the examples (each attends only within itself); 0 leaves it out."""
    # matmul_params: the planner's count (decoder layers + LM head, no embedding lookup)
    from sft.planning.memory import head_dim, matmul_params

    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * attention_pairs
    return (4 if frozen else 6) * matmul_params(config) * tokens + attention


# ---- orchestration (parent process) ----

def spawn(args: argparse.Namespace, tool: str, packing: str, workdir: Path, cache: Path) -> dict:
    command = [sys.executable, __file__, "--worker", tool, "--packing", packing, "--workdir", str(workdir),
               "--cache", str(cache), "--rows", str(args.rows), "--steps", str(args.steps), "--batch",
               str(args.batch), "--max_length", str(args.max_length), "--device", args.device]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tool} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(runs: list[dict]) -> dict:
    """Per-key median over repeats (losses from the first run)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    merged = dict(runs[0])
    merged.update({k: statistics.median(r[k] for r in runs) for k in keys if all(r[k] is not None for r in runs)})
    return merged


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    settings = ["off", "on"] if args.packing == "both" else [args.packing]
    results = {"peak_flops": matmul_peak(args.device), "settings": {}}
    for packing in settings:
        runs: dict[str, list] = {"sft": [], "trl": []}
        for repeat in range(args.repeats):  # pairs back to back, each in a fresh process and a fresh cache
            for tool in ("trl", "sft"):
                cache = workdir / f"cache-{tool}-{packing}-{repeat}"
                runs[tool].append(spawn(args, tool, packing, workdir, cache))
                print(f"  {tool:>3} packing={packing} run {repeat + 1}: {runs[tool][-1]['step_seconds']:.3f} s/step",
                      file=sys.stderr)
        cached = spawn(args, "sft", packing, workdir, workdir / f"cache-sft-{packing}-0")  # same cache: 2nd run
        results["settings"][packing] = {"sft": median_run(runs["sft"]), "trl": median_run(runs["trl"]),
                                        "sft_cached_prep_seconds": cached["prep_seconds"]}
    return results


def bare_tokenizer_rows_per_s(workdir: Path) -> float:
    """The practical limit: the fast tokenizer alone, batched with offsets, over the same rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    rows = [json.loads(line) for line in (workdir / "data.jsonl").read_text().splitlines()]
    texts = [r["prompt"] + r["completion"] for r in rows]
    start = time.perf_counter()
    for i in range(0, len(texts), 1000):
        tokenizer(texts[i:i + 1000], return_offsets_mapping=True)
    return len(texts) / (time.perf_counter() - start)


def chat_rows_per_s(repeats: int) -> dict[str, float]:
    """Chat preprocessing speed: every row of two real chat fixtures rendered through the tokenizer's template
    (assistant spans located) and tokenized with labels; rows per CPU second of the best of `repeats` passes,
    which a shared machine disturbs far less than a wall-clock median."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from sft.data.chat import ChatRenderer
    from sft.data.encode import Encoding

    chat = FIXTURES / "datasets" / "chat"
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "tokenizers" / "qwen2.5-coder-3b-instruct")
    renderer, encoding = ChatRenderer(tokenizer), Encoding(tokenizer, 4096)
    results = {}
    for name in ("fastchat_dummy_conversation.json", "llamafactory_glaive_toolcall_en_demo.json"):
        rows = json.loads((chat / name).read_text())
        seconds = []
        for _ in range(repeats):
            start = time.process_time()
            encoding.encode([e for number, row in enumerate(rows, 1) for e in renderer.render_row(row, name, number)])
            seconds.append(time.process_time() - start)
        results[name] = len(rows) / min(seconds)
    return results


def table(results: dict) -> str:
    peak = results["peak_flops"]
    lines = [f"matmul peak measured: {peak / 1e9:.1f} GFLOP/s; bare tokenizer: {results['bare_rows_per_s']:,.0f} rows/s",
             f"{'packing':<8}{'metric':<30}{'trl':>14}{'sft':>14}{'sft/trl':>10}", "-" * 76]
    for packing, res in results["settings"].items():
        trl, sft = res["trl"], res["sft"]
        rows = [("preprocessing rows/s", "prep_rows_per_s", "{:,.0f}"),
                ("packing efficiency", "packing_efficiency", "{:.2%}"),
                ("seconds / step", "step_seconds", "{:.3f}"), ("tokens/s (total)", "tokens_per_s", "{:,.0f}"),
                ("tokens/s (trained)", "trained_tokens_per_s", "{:,.0f}"),
                ("peak memory (GB)", "peak_memory_bytes", "{:.2f}"), ("final loss", "final_loss", "{:.4f}")]
        for label, key, fmt in rows:
            a, b = trl.get(key), sft.get(key)
            if a is None or b is None:
                continue
            scale = 1e-9 if key == "peak_memory_bytes" else 1.0
            ratio = f"{b / a:.2f}x" if a else "-"
            lines.append(f"{packing:<8}{label:<30}{fmt.format(a * scale):>14}{fmt.format(b * scale):>14}{ratio:>10}")
        for tool, res_tool in (("trl", trl), ("sft", sft)):
            res_tool["mfu"] = res_tool["model_flops_per_step"] / res_tool["step_seconds"] / peak
        lines.append(f"{packing:<8}{'model FLOP utilisation':<30}{trl['mfu']:>14.1%}{sft['mfu']:>14.1%}"
                     f"{sft['mfu'] / trl['mfu']:>9.2f}x")
        speedup = sft["prep_seconds"] / res["sft_cached_prep_seconds"]
        lines.append(f"{packing:<8}{'sft cached preprocessing':<30}{'':>14}{res['sft_cached_prep_seconds']:>13.2f}s"
                     f"{speedup:>9.1f}x")
        if packing == "off":
            diffs = [abs(a - b) / abs(a) for a, b in zip(trl["losses"], sft["losses"])]
            lines.append(f"{packing:<8}{'max per-step loss difference':<30}{'':>14}{max(diffs):>14.3%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gpu_worker or args.model or args.suite:
        import bench_gpu

        if args.gpu_worker:
            print(json.dumps(bench_gpu.worker(json.loads(args.gpu_worker))))
        else:
            bench_gpu.main(args)
        return
    if args.chat:
        print(json.dumps(chat_rows_per_s(args.repeats)))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not ALPACA.exists():
        print("note: ../shared/fixtures is absent; using the project's data and tokenizer", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="sft-bench-") as tmp:
        workdir = Path(tmp)
        make_workdir(args, workdir)
        results = measure(args, workdir)
        results["bare_rows_per_s"] = bare_tokenizer_rows_per_s(workdir)
    results["setup"] = {k: v for k, v in vars(args).items() if k not in ("worker", "workdir", "cache", "json")}
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
