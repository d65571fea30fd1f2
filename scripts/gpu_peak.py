"""What is live at a GPU's memory peak in sft plan's simulated step: the allocations torch's allocator holds at the
peak of two real optimizer steps, by the source line that made them (the planner's tests compare only totals).

    python scripts/gpu_peak.py --model Qwen/Qwen2.5-0.5B --method full --micro 1
    python scripts/gpu_peak.py --model Qwen/Qwen2.5-0.5B --method full --micro 4 --budget 0.8   # compiled blocks

On a CPU machine it prints the simulated step's peak (MemTracker) and stops: the allocator's history needs CUDA.
"""

import argparse
import collections
import os

import torch

from sft.models.architectures import known_config
from sft.models.compilation import compile_blocks
from sft.planning import memory
from sft.planning import plan as planner
from sft.planning.memtrace import build_model, trace_step, train_steps
from sft.training.recipe import load_recipe

GIB = 2 ** 30


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B", help="a model sft.models.architectures knows")
    parser.add_argument("--method", choices=("full", "lora"), default="full")
    parser.add_argument("--micro", type=int, default=1, help="per_device_train_batch_size")
    parser.add_argument("--length", type=int, default=2048, help="max_length (every position trained)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--budget", type=float, help="torch_compile with this activation_memory_budget")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (training runs in bf16)")
    parser.add_argument("--top", type=int, default=16, help="source lines to list")
    return parser.parse_args()


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch itself: the line of sft, transformers or peft that allocated."""
    for frame in frames:
        if f"{os.sep}torch{os.sep}" not in frame["filename"]:
            return f"{frame['filename'].rsplit(os.sep, 2)[-1]}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


def live_at_peak(events: list[dict]) -> tuple[int, dict[int, dict], dict]:
    """Replays the allocator's alloc / free events: the peak of allocated bytes, the blocks live then and the
    allocation that reached it."""
    def replay(stop: int | None) -> tuple[int, int, dict[int, dict]]:
        live, now, peak, at = {}, 0, 0, 0
        for index, event in enumerate(events[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                now += event["size"]
                if now > peak:
                    peak, at = now, index
            elif event["action"] == "free_requested" and event["addr"] in live:
                now -= live.pop(event["addr"])["size"]
        return peak, at, live

    peak, at, _ = replay(None)
    return peak, replay(at + 1)[2], events[at]


def main() -> None:
    args = arguments()
    values = dict(model_name_or_path=args.model, dataset="unused.json", output_dir="unused", dtype=args.dtype, bf16=True,
                  per_device_train_batch_size=args.micro, max_length=args.length,
                  activation_checkpointing=args.checkpointing, use_peft=args.method == "lora")
    if args.budget:
        values |= {"torch_compile": True, "activation_memory_budget": args.budget}
    config, arch = load_recipe(values), known_config(args.model)
    setup = planner.setup_of(config, 1, 1)
    parts = memory.memory_breakdown(config, arch, setup, planner.model_facts(config, arch, setup.method))
    print(f"planned {memory.train_peak(parts, setup) / GIB:.3f} GiB:",
          ", ".join(f"{k} {v / GIB:.3f}" for k, v in parts.items() if v))
    if not torch.cuda.is_available():
        print(f"simulated step (CPU, MemTracker): {trace_step(config, arch).peak / GIB:.3f} GiB")
        return
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model = build_model(config, arch, "cuda")
    if args.budget:
        compile_blocks(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    with torch._functorch.config.patch(activation_memory_budget=args.budget or 1.0):
        train_steps(model, optimizer, config, arch.get_text_config().vocab_size, "cuda")
    events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, live, last = live_at_peak(events)
    print(f"max_memory_allocated {torch.cuda.max_memory_allocated() / GIB:.3f} GiB; replayed peak {peak / GIB:.3f} "
          f"GiB, {len(live)} blocks live ({len(events)} events)")
    by_site = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        entry = by_site[site(event["frames"])]
        entry[0] += event["size"]
        entry[1] += 1
    for name, (nbytes, count) in sorted(by_site.items(), key=lambda item: -item[1][0])[:args.top]:
        print(f"{nbytes / GIB:9.3f} GiB {count:6d}  {name}")
    print("the peak's allocation:", " <- ".join(site([frame]) for frame in last["frames"][:12]
                                               if f"{os.sep}torch{os.sep}" not in frame["filename"]))


if __name__ == "__main__":
    main()
