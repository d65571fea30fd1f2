"""torch_compile's cost and result through SFTTrainer: eager, the whole model compiled (accelerate's torch.compile,
what sft did before), and sft's in-place compile of each decoder block (sft.models.compilation).

    python scripts/bench_compile.py                                  # CPU: 8 and 24 layers, bf16 autocast
    python scripts/bench_compile.py --device cuda --layers 16,24 --hidden 896 --json $OUT/compile.json

Each mode runs in a fresh process with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), so the first
step pays the whole compile. The job: a Llama of `--hidden` (intermediate 2x, heads of 32 dims, 2 KV heads,
vocabulary 4096, seed 0, fp32 weights, bf16 autocast), packed rows of `--length` tokens holding examples of random
lengths with restarting position_ids (sft's PackedCollator), AdamW, `--steps` steps.

Per mode: seconds to the end of the first optimizer step (from trainer.train(), the model already built), the median
of the later steps, the graphs dynamo built, and the largest difference of the logged losses from eager's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("eager", "whole", "blocks")


def worker(spec: dict) -> dict:
    """One mode in this process: build the model and rows, train, time the steps."""
    import datasets
    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    sys.path.insert(0, str(REPO))
    import sft.training.trainer as trainer_module
    from sft import SFTConfig, SFTTrainer

    if spec["mode"] == "whole":  # accelerate compiles the whole model, as sft's torch_compile did before
        trainer_module.compiles_blocks = lambda model, args: False
    torch.manual_seed(0)
    hidden = spec["hidden"]
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=spec["layers"],
        num_attention_heads=hidden // 32, num_key_value_heads=2, vocab_size=4096, use_cache=False,
        attn_implementation="sdpa", tie_word_embeddings=False))
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(spec["batch"] * spec["steps"]):
        lengths = torch.randint(64, spec["length"] // 2, (8,), generator=generator).tolist()
        positions = [p for n in lengths for p in range(n)][:spec["length"]]
        ids = torch.randint(5, 4096, (len(positions),), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ids, "position_ids": positions})
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            ends.append(time.time())

    args = SFTConfig(output_dir=spec["out"], per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
                     learning_rate=1e-4, logging_steps=1, report_to="none", save_strategy="no", seed=0, packing=True,
                     bf16=True, use_cpu=spec["device"] == "cpu", torch_compile=spec["mode"] != "eager",
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=None, data_collator=trainer_module.PackedCollator(0), callbacks=[Clock()])
    start = time.time()
    trainer.train()
    return {"mode": spec["mode"], "layers": spec["layers"], "first_step_s": ends[0] - start,
            "later_step_s": statistics.median(b - a for a, b in zip(ends, ends[1:])),
            "graphs": counters["stats"]["unique_graphs"],
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def run(spec: dict) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        return {"mode": spec["mode"], "layers": spec["layers"], "error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", default="8,24", help="comma-separated depths")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--length", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    import tempfile

    results = []
    print(f"{'layers':>6} {'mode':<7}{'1st step s':>11}{'later step s':>13}{'graphs':>7}  max |loss - eager|")
    with tempfile.TemporaryDirectory() as out:
        for layers in map(int, args.layers.split(",")):
            eager = None
            for mode in args.modes.split(","):
                spec = {"mode": mode, "layers": layers, "out": out} | {
                    k: getattr(args, k) for k in ("device", "hidden", "length", "batch", "steps")}
                result = run(spec)
                results.append(result)
                if "error" in result:
                    print(f"{layers:>6} {mode:<7}failed: {result['error'][:80]}")
                    continue
                eager = result["losses"] if mode == "eager" else eager
                gap = max(abs(a - b) for a, b in zip(result["losses"], eager)) if eager else float("nan")
                print(f"{layers:>6} {mode:<7}{result['first_step_s']:>11.1f}{result['later_step_s']:>13.3f}"
                      f"{result['graphs']:>7}  {gap:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
