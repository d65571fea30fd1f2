"""How a ZeRO-3 run ends, replayed through sft's real `main`, for tests run under torchrun.

`torchrun --nproc_per_node 3 tests/exit_probe.py sft|stopped|skip OUT_DIR`: every rank opens gloo's group and a
second group it keeps (as DeepSpeed keeps its groups); rank 0 arrives late at 8 async all-gathers on it (the final
save's parameter gathers, DeepSpeed's _allgather_params_coalesced), then holds a core a while (serialising the
checkpoint) before it joins one more all-gather nobody waits for (the next layer's prefetch), so the other ranks
reach interpreter exit with a collective still running. Each rank writes rank{R}.json: when its work ended and when
`main` returned. `skip` leaves out sft.cli.console.end_distributed (the negative control): the gloo worker thread
then finishes and releases that work's tensors while the interpreter finalizes, and the rank may abort (SIGABRT).
`stopped` ends with a stop every rank agreed on (a signal: TrainingInterrupted, exit 143) instead of success.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sft.cli import main as cli
from sft.errors import TrainingInterrupted

HELD = []  # groups a library keeps to interpreter exit, as DeepSpeed does
GATHERS, WIDTH = 8, 4096


def final_save(args, rest) -> None:
    """Stands in for `sft train`: the last collectives of a ZeRO-3 save, rank 0 last in and last out."""
    dist.init_process_group("gloo")
    HELD.append(dist.new_group(backend="gloo"))
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(0.2)
    shards = [torch.full((WIDTH,), float(rank)) for _ in range(GATHERS)]
    gathered = [[torch.empty(WIDTH) for _ in range(dist.get_world_size())] for _ in shards]
    works = [dist.all_gather(out, shard, group=HELD[0], async_op=True) for out, shard in zip(gathered, shards)]
    for work in works:
        work.wait()
    # The next layer's prefetch, which nobody waits for: rank 0 joins it after its write, when the others may
    # already be finalizing their interpreter.
    if rank == 0:
        busy(1.0)
    prefetch = [torch.empty(WIDTH) for _ in range(dist.get_world_size())]
    dist.all_gather(prefetch, shards[0], group=HELD[0], async_op=True)
    stamps["done"] = time.time()
    if mode == "stopped":
        raise TrainingInterrupted("Stopped by SIGTERM at step 2", 128 + 15)


def busy(seconds: float) -> None:
    """Hold a core, as serialising a checkpoint does: the other ranks' gloo threads wait for CPU time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SlowTeardown:
    """Interpreter exit takes a while (torch, transformers and DeepSpeed tear down many modules): this finalizer,
    run while the interpreter finalizes __main__, stands for it, so the replay does not hang on the machine's load.
    It holds the groups, so they outlive it whatever order the interpreter clears __main__ in."""

    def __init__(self, groups: list) -> None:
        self.groups = groups

    def __del__(self, sleep=time.sleep) -> None:  # bound now: module globals may be gone by then
        sleep(2.0)


if __name__ == "__main__":
    slow_teardown = SlowTeardown(HELD)
    mode, out = sys.argv[1], Path(sys.argv[2])
    stamps = {}
    cli.run_train = final_save
    if mode == "skip":
        cli.end_distributed = lambda error=None: None
    code = cli.main(["train", "recipe.yaml"])
    stamps["left"] = time.time()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(stamps))
    sys.exit(code)
