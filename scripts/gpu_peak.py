"""What is live at the memory peak of sft plan's simulated step, by the source line that made it (the planner's
tests compare only totals). On a GPU: the allocations torch's allocator holds at the peak of two real optimizer
steps. On a CPU: the step `sft plan --trace` simulates (fake tensors, CUDA's autocast and dropout acted out), each
new storage charged to the line or the autograd node that made it; the two listings side by side show where the
simulation and the GPU part. Compare sites, not totals: the CPU listing's total (every storage an operator returned,
until its last reference goes) came out above MemTracker's peak of the same step (Qwen2.5-0.5B full, micro 1: 8.05 vs
7.13 GiB; the H100: 6.81), a gap not yet explained.

    python scripts/gpu_peak.py --model Qwen/Qwen2.5-0.5B --method full --micro 1
    python scripts/gpu_peak.py --model Qwen/Qwen2.5-0.5B --method full --micro 4 --budget 0.8   # compiled blocks
"""

import argparse
import collections
import os
import traceback
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sft.models.architectures import known_config
from sft.models.compilation import compile_blocks
from sft.planning import memory
from sft.planning import plan as planner
from sft.planning.memtrace import build_model, materialize, train_steps
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


ACTING_OUT = (f"{os.sep}torch{os.sep}", "cuda_autocast.py")  # torch, and the simulation's own dispatch


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch itself: the line of sft, transformers or peft that allocated."""
    for frame in frames:
        if not any(part in frame["filename"] for part in ACTING_OUT):
            return f"{frame['filename'].rsplit(os.sep, 2)[-1]}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


class StorageEvents(TorchDispatchMode):
    """Each new storage an operator makes (its bytes and where: the autograd node in backward, else the first line
    outside torch) and each storage freed, as the allocator's history records them on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.events, self.seen = [], set()

    def free(self, key: int) -> None:
        self.seen.discard(key)
        self.events.append({"action": "free_requested", "addr": key})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            storage = tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else None
            if storage is None or id(storage) in self.seen:
                continue
            key = id(storage)
            self.seen.add(key)
            weakref.finalize(storage, self.free, key)
            node = torch._C._current_autograd_node()
            frames = ([{"filename": "autograd", "line": 0, "name": node.name()}] if node is not None else
                      [{"filename": f.filename, "line": f.lineno, "name": f.name}
                       for f in reversed(traceback.extract_stack()[:-1])])
            self.events.append({"action": "alloc", "addr": key, "size": storage.nbytes(), "frames": frames})
        return out


def simulated_events(config, arch) -> tuple[list[dict], int]:
    """The CPU-simulated step's storage events, and the bytes of the weights made before it."""
    model = build_model(config, arch, "meta")
    with FakeTensorMode():
        materialize(model)
        weights = sum({id(t): t.nbytes for t in [*model.parameters(), *model.buffers()]}.values())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
        with StorageEvents() as recorder:
            train_steps(model, optimizer, config, arch.get_text_config().vocab_size, "cpu")
    return recorder.events, weights


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


def gpu_events(config, arch, budget: float | None) -> tuple[list[dict], int]:
    """The allocator's history of two real optimizer steps on the GPU, the model built inside it."""
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model = build_model(config, arch, "cuda")
    if budget:
        compile_blocks(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    train_steps(model, optimizer, config, arch.get_text_config().vocab_size, "cuda")
    events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    return events, 0


def main() -> None:
    args = arguments()
    values = dict(model_name_or_path=args.model, dataset="unused.json", output_dir="unused", dtype=args.dtype,
                  bf16=True, per_device_train_batch_size=args.micro, max_length=args.length,
                  activation_checkpointing=args.checkpointing, use_peft=args.method == "lora")
    if args.budget:
        values |= {"torch_compile": True, "activation_memory_budget": args.budget}
    config, arch = load_recipe(values), known_config(args.model)
    setup = planner.setup_of(config, 1, 1)
    parts = memory.memory_breakdown(config, arch, setup, planner.model_facts(config, arch, setup.method))
    print(f"planned {memory.train_peak(parts, setup) / GIB:.3f} GiB:",
          ", ".join(f"{k} {v / GIB:.3f}" for k, v in parts.items() if v))
    with torch._functorch.config.patch(activation_memory_budget=args.budget or 1.0):
        if torch.cuda.is_available():
            events, weights = gpu_events(config, arch, args.budget)
            print(f"max_memory_allocated {torch.cuda.max_memory_allocated() / GIB:.3f} GiB")
        else:
            events, weights = simulated_events(config, arch)
    peak, live, last = live_at_peak(events)
    print(f"peak {(peak + weights) / GIB:.3f} GiB ({weights / GIB:.3f} of weights made before the step), {len(live)} "
          f"blocks live ({len(events)} events)")
    by_site = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        entry = by_site[site(event["frames"])]
        entry[0] += event["size"]
        entry[1] += 1
    for name, (nbytes, count) in sorted(by_site.items(), key=lambda item: -item[1][0])[:args.top]:
        print(f"{nbytes / GIB:9.3f} GiB {count:6d}  {name}")
    print("the peak's allocation:", " <- ".join(site([frame]) for frame in last["frames"][:12]
                                               if not any(part in frame["filename"] for part in ACTING_OUT)))


if __name__ == "__main__":
    main()
