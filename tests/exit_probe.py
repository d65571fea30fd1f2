"""How a ZeRO-3 run ends, replayed through sft's real `main`, for tests run under torchrun.

`torchrun --nproc_per_node 3 tests/exit_probe.py sft|skip OUT_DIR`: every rank opens gloo's group and a second group
it keeps (as DeepSpeed keeps its groups); rank 0 arrives late at 8 async all-gathers on it (the final save's parameter
gathers, DeepSpeed's _allgather_params_coalesced), then holds a core a while (serialising the checkpoint), so the
other ranks reach interpreter exit right after their last collective. Each rank writes rank{R}.json: when its work
ended and when `main` returned. `skip` leaves out sft.cli.console.end_distributed (the negative control): a gloo
worker thread may then release a finished work's tensor while the interpreter finalizes, and the rank aborts (SIGABRT).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sft.cli import main as cli

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
    if rank == 0:
        busy(0.3)
    stamps["done"] = time.time()


def busy(seconds: float) -> None:
    """Hold a core, as serialising a checkpoint does: the other ranks' gloo threads wait for CPU time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    stamps = {}
    cli.run_train = final_save
    if mode == "skip":
        cli.end_distributed = lambda: None
    code = cli.main(["train", "recipe.yaml"])
    stamps["left"] = time.time()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(stamps))
    sys.exit(code)
