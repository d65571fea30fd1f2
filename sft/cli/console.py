"""What every verb shares: logging set up for people, import-time noise silenced, the recipe keys' help text, the
process group closed at the end."""

import logging
import os
import sys

from sft.errors import SFTError


def setup_logging() -> None:
    """Readable INFO logs from sft and transformers' Trainer, from one process. Under a launcher every rank
    prepares the same data and loads the same model, so the other ranks (RANK > 0, set by torchrun, accelerate
    and deepspeed) would print each table, note and warning and each loading bar once more per process; they log
    sft's errors only and show no progress bars (the Trainer already keeps its own logs to the main process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("sft").setLevel(logging.ERROR if is_replica() else logging.INFO)
    if is_replica():
        import datasets
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
        datasets.disable_progress_bars()


def is_replica() -> bool:
    """Whether this process is one of a launch's other ranks (RANK > 0): what every rank computes alike, such as
    sft eval's results, is printed by rank 0 alone."""
    return os.environ.get("RANK", "0") not in ("", "0")


def quiet_optional_backends() -> None:
    """The command, not the library, silences import-time noise: DeepSpeed (imported by transformers' Trainer)
    warns on every import when it finds no GPU unless told up front, and bitsandbytes warns about optional CPU
    kernels. `import sft` changes neither the environment nor logging."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def recipe_keys_help() -> str:
    """Every recipe key with its type and help text, from the SFTConfig dataclass."""
    from transformers import HfArgumentParser

    from sft.config.arguments import SFTConfig

    text = HfArgumentParser(SFTConfig, prog="sft").format_help()
    return "recipe keys:" + text.split("options:", 1)[-1]


def closed_stdout() -> int:
    """The exit code after the program reading sft's output (`| head`, `| less`) closed the pipe: what a shell
    reports for a command SIGPIPE ended (128 + 13). stdout goes to the null device first, since Python's flush of it
    at exit would raise the same error again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def end_distributed(error: SFTError | None = None) -> None:
    """Let the ranks leave together, then close the process group a launcher (torchrun, accelerate, deepspeed)
    opened. A rank that reaches interpreter exit right after its last collective (ZeRO-3's fast ranks while rank 0
    still writes the checkpoint) can abort (SIGABRT, "terminate called without an active exception") when a gloo
    worker thread releases a finished work's tensor while the interpreter finalizes; the launcher then reports the
    whole job failed. Waiting in a barrier releases the GIL until every rank is done, so those threads finish first
    (tests/exit_probe.py). On success (no `error`), and after a stop every rank agreed on (SFTError.every_rank: a
    signal, a diverged step): after another error other ranks may never reach the barrier."""
    if error is not None and not error.every_rank:
        return
    if "torch" not in sys.modules:  # nothing distributed ran (sft --help, sft plan without torch.distributed)
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # what accelerate's wait_for_everyone calls
        dist.destroy_process_group()
