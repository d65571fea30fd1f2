"""Atomic checkpoints: each checkpoint-N is written under a staging folder and renamed into place when complete.

transformers writes checkpoint-N in place, so a crash mid-save leaves a folder that `resume_from_checkpoint=True`
picks as the latest, and save_total_limit may already have deleted the previous complete one. Staging folders
(`.staging-N/`) never match the Trainer's `checkpoint-N` pattern, so they are neither resumed from nor rotated.
"""

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from sft import rundir
from sft.errors import SFTError
from sft.training.data_order import ORDER_KEY, data_order

log = logging.getLogger(__name__)
STAGING_PREFIX = ".staging-"
BATCH_KEY = "sft_batch"  # in TrainerState.stateful_callbacks, which every checkpoint saves (see batch_shape)
LOSS_KEY = "sft_loss_sum"  # there too: the sum of every step's loss so far, for a resumed run's train_loss
RESUME_KEYS = (BATCH_KEY, ORDER_KEY)  # there too: what a resume must match (resume_facts), checked before it loads


def is_resumable(folder: Path) -> bool:
    """Whether `folder` is a checkpoint the Trainer resumes exactly: trainer_state.json plus the optimizer's state
    (optimizer.pt, accelerate's optimizer.bin or FSDP's sharded optimizer_N/) or DeepSpeed's global_stepN/, which
    holds it. A finished run's folder has trainer_state.json and weights but no optimizer: the Trainer would load
    the weights and quietly restart the optimizer and the learning-rate schedule (warm-up included)."""
    if not (folder / "trainer_state.json").is_file():
        return False
    return any(entry.name.startswith("optimizer") or (entry.is_dir() and entry.name.startswith("global_step"))
               for entry in folder.iterdir())


def batch_shape(args: TrainingArguments) -> dict[str, int]:
    """What one optimizer step takes: micro-batches (per process), accumulated, on every process."""
    return {"per_device_train_batch_size": args.train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, "processes": args.world_size}


def resume_facts(args: TrainingArguments, dataset: Any) -> dict[str, dict]:
    """What a checkpoint records for a resume to match: the rows per optimizer step and the data order."""
    return {BATCH_KEY: batch_shape(args), ORDER_KEY: data_order(args, dataset)}


def check_same_batch(folder: Path, args: TrainingArguments) -> None:
    """A checkpoint resumes exactly only at the rows per optimizer step it was trained with. The Trainer skips the
    rows already trained by counting steps at the new size: 3 steps of 16 rows resumed at 32 rows a step skip 96
    rows, 48 of them never trained, and the epoch and learning-rate schedule move with them. Checkpoints from
    before sft recorded it (no BATCH_KEY) are not checked."""
    state = json.loads((folder / "trainer_state.json").read_text() or "{}")
    saved = (state.get("stateful_callbacks") or {}).get(BATCH_KEY)
    now = batch_shape(args)
    if not saved:
        return
    saved = {name: saved[name] for name in now}  # trainer_state.json sorts its keys
    if math.prod(saved.values()) == math.prod(now.values()):
        _check_same_grouping(folder, saved, now, args)
        if saved["processes"] != now["processes"]:  # transformers says so at info level only
            log.warning("Resuming %s on %d processes; it was trained on %d. The rows per step are the same, but each "
                        "process's random state (dropout, NEFTune noise) cannot be restored on another process "
                        "count, so the run will not equal the uninterrupted one exactly.", folder, now["processes"],
                        saved["processes"])
        return
    rows, per_step = math.prod(saved.values()), now["per_device_train_batch_size"] * now["processes"]
    fix = (f"--gradient_accumulation_steps {rows // per_step}" if rows % per_step == 0
           else "per_device_train_batch_size, gradient_accumulation_steps and the process count")
    raise SFTError(f"resume_from_checkpoint: {folder} was trained on {rows} rows per optimizer step "
                   f"({_shape(saved)}), and this run takes {math.prod(now.values())} ({_shape(now)}). The Trainer "
                   "would skip the rows already trained by counting steps at the new size, so some would be "
                   f"trained twice or never. Resume with {fix} to take {rows} rows a step, or start a new run "
                   f"from its weights with --model_name_or_path {folder}.")


def _check_same_grouping(folder: Path, saved: dict[str, int], now: dict[str, int], args: TrainingArguments) -> None:
    """group_by_length orders rows by length within mega-batches of 50 x the rows each process takes per step
    (transformers' LengthGroupedSampler): at the same rows per step on another process count the rows come in
    another order. A 2-process run resumed on 1 (gradient accumulation doubled) 2 steps into its second epoch
    ended 6.3e-5 away from the uninterrupted run; the same resume in random order, 1.3e-7 after 5 steps."""
    rows = {shape["per_device_train_batch_size"] * shape["gradient_accumulation_steps"] for shape in (saved, now)}
    if getattr(args, "train_sampling_strategy", None) != "group_by_length" or len(rows) == 1:
        return
    raise SFTError(f"resume_from_checkpoint: {folder} was trained with train_sampling_strategy group_by_length on "
                   f"{_shape(saved)}, and this run takes {_shape(now)}. group_by_length orders rows in groups of 50 x "
                   "per_device_train_batch_size x gradient_accumulation_steps, so the resumed run would train other "
                   "rows than the run it continues. Resume with the checkpoint's per_device_train_batch_size, "
                   "gradient_accumulation_steps and process count, or start a new run from its weights with "
                   f"--model_name_or_path {folder}.")


def best_of_resumed(folder: Path) -> str | None:
    """The best checkpoint a resume from `folder` goes on with. trainer_state.json records it by the path it was saved
    at: in a run folder since moved or copied (or an output_dir given from another working directory) the Trainer
    found no folder there and forgot it, while keeping best_metric, so no later evaluation became the best again;
    save_total_limit then rotated the best checkpoint away and load_best_model_at_end kept the last weights (eval
    loss 8.29 saved for a best of 11.13). The best checkpoint beside `folder`, where the run moved it, comes first."""
    state = json.loads((folder / "trainer_state.json").read_text() or "{}")
    recorded = state.get("best_model_checkpoint")
    if not recorded:
        return None
    beside = folder.parent / Path(recorded).name
    if beside.is_dir():
        if str(beside) != recorded:  # the Trainer has just said it ignores the recorded one
            log.warning("The best checkpoint so far, recorded as %s, is %s now: keeping it as the best.",
                        recorded, beside)
        return str(beside)
    return recorded if Path(recorded).is_dir() else None


def _shape(shape: dict[str, int]) -> str:
    return " x ".join(f"{name} {value}" for name, value in shape.items())


def staging_root(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint-`step` is written before it is complete."""
    return Path(run_dir) / f"{STAGING_PREFIX}{step}"


def promote(run_dir: str | Path, step: int) -> Path:
    """Move a completed staged checkpoint to run_dir/checkpoint-`step` (atomic rename) and drop the staging dir."""
    staged = staging_root(run_dir, step) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    final = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    _fix_state_paths(staged / "trainer_state.json", str(staged), str(final))
    if final.exists():  # the same step saved again (e.g. by a resumed run): the new save is complete, replace it
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(Path(run_dir))
    shutil.rmtree(staging_root(run_dir, step), ignore_errors=True)
    return final


def rotate(run_dir: str | Path, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Delete the oldest complete checkpoints beyond save_total_limit, by step (the newest always stays)."""
    rotate_checkpoints(str(run_dir), save_total_limit, best_model_checkpoint, use_mtime=False)


def remove_stale_staging(run_dir: str | Path) -> None:
    """Delete staging folders left by a run that died mid-save."""
    for stale in Path(run_dir).glob(f"{STAGING_PREFIX}*"):
        log.warning("Removing incomplete checkpoint %s left by an interrupted save.", stale)
        shutil.rmtree(stale, ignore_errors=True)


class CheckpointStaging:
    """One trainer's checkpoint saves: the Trainer writes into a staging folder (`folder`, while a save runs), which
    is promoted once every rank has written its shard."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.folder: str | None = None  # the Trainer's output dir during a save

    @contextlib.contextmanager
    def writing(self, run_dir: str, step: int) -> Iterator[None]:
        """The Trainer's save of checkpoint-`step` runs inside: it writes under the staging folder."""
        self.folder = str(staging_root(run_dir, step))
        try:
            yield
        finally:
            self.folder = None

    def finish(self, run_dir: str, state: TrainerState, args: TrainingArguments) -> None:
        """Rename the complete checkpoint into place and rotate old ones (main process), ranks in step."""
        step = state.global_step
        self.accelerator.wait_for_everyone()  # every rank has written its shard
        best = state.best_model_checkpoint
        if best and best.startswith(str(staging_root(run_dir, step))):
            # On every rank: each loads the best model from there at the end (load_best_model_at_end; ZeRO-3 ranks
            # their own shards), and the staging folder is gone by then.
            state.best_model_checkpoint = str(Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if args.should_save:
            if rundir.is_run(Path(run_dir)):  # sft train's run (not a Trainer used from Python): the folder is sft's
                rundir.claim(Path(run_dir), [], folders=(f"{PREFIX_CHECKPOINT_DIR}-{step}",))
            promote(run_dir, step)
            rotate(run_dir, args.save_total_limit, state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()


def _fix_state_paths(state_file: Path, staged: str, final: str) -> None:
    """The Trainer records best_model_checkpoint with the path it saved to; point it at the final folder."""
    if not state_file.exists():
        return
    text = state_file.read_text()
    if staged in text:
        state_file.write_text(text.replace(json.dumps(staged)[1:-1], json.dumps(final)[1:-1]))


def _fsync_dir(path: Path) -> None:
    """Make the rename durable before older checkpoints are deleted."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_renamed_weights(model: nn.Module, folder: str | os.PathLike) -> bool:
    """Load the whole-model weights of checkpoint `folder` into `model` where the file names them otherwise than the
    model's modules; False where the Trainer's own loading applies (an adapter, matching names, no such file).

    transformers 5 saves some models under their checkpoint names (Gemma-3 4B+ writes `vision_tower.*` and
    `language_model.*` for the modules `model.vision_tower.*` and `model.language_model.*`; Mixtral and Qwen2/3-MoE
    one tensor per expert for their fused experts), and the Trainer loads a checkpoint (resume,
    load_best_model_at_end) with load_state_dict(strict=False): those tensors were missed, and the run went on from
    the weights it had, with a warning. from_pretrained reads those names; its weights are copied in."""
    folder = Path(folder)
    if not isinstance(model, PreTrainedModel) or not (saved := saved_tensor_names(folder)):
        return False
    if saved <= set(model.state_dict()):
        return False
    loaded = type(model).from_pretrained(folder, dtype="auto", device_map={"": "cpu"})
    missing = model.load_state_dict(loaded.state_dict(), strict=False).missing_keys
    if missing:
        raise SFTError(f"Could not load the weights of {folder}: {len(missing)} of the model's tensors are not in it "
                       f"(e.g. {missing[0]}).")
    return True


def saved_tensor_names(folder: Path) -> set[str]:
    """The tensor names of a checkpoint's model.safetensors (or its sharded index); empty when it has none."""
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if (folder / SAFE_WEIGHTS_NAME).is_file():
        with safe_open(folder / SAFE_WEIGHTS_NAME, "pt") as file:
            return set(file.keys())
    return set()
