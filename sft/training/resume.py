"""Resuming a run: the checkpoint a resume continues, and the checks that it resumes exactly (a checkpoint, at
this run's rows per optimizer step, data-order settings and training data), each before the work it would waste."""

from pathlib import Path

import datasets
from transformers.trainer_utils import get_last_checkpoint

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.training.checkpoints import check_same_batch, is_resumable
from sft.training.data_order import check_same_data, check_same_settings


def resume_setting(value: str | bool | None) -> str | bool | None:
    """`resume_from_checkpoint` as the Trainer takes it: True for the latest checkpoint, or a path."""
    if isinstance(value, str) and value.lower() in ("true", "false", "none", ""):
        return value.lower() == "true" or None
    return value


def check_resume(out: Path, resume: str | bool | None, config: SFTConfig) -> None:
    """The checkpoint a resume asks for exists and resumes exactly: a given path, or (true) the newest checkpoint-N
    folder in output_dir, trained at this run's rows per optimizer step and settings of the data order."""
    if isinstance(resume, str) and not Path(resume).expanduser().is_dir():
        raise SFTError(f"resume_from_checkpoint: {resume} does not exist. Give a checkpoint-N folder of a run, or "
                       "true for the newest checkpoint in output_dir.")
    if resume is True and (not out.is_dir() or get_last_checkpoint(str(out)) is None):
        raise SFTError(f"resume_from_checkpoint is true but output_dir {out} holds no checkpoint-N folder. Train "
                       "without --resume_from_checkpoint, or point it at a checkpoint folder.")
    if resume:
        folder = resumed_checkpoint(out, resume)
        check_checkpoint(folder, out)
        check_same_batch(folder, config)
        check_same_settings(folder, config)


def resumed_checkpoint(out: Path, resume: str | bool) -> Path:
    """The checkpoint a resume continues: the given folder, or (true) the newest checkpoint-N in output_dir."""
    return Path(get_last_checkpoint(str(out)) if resume is True else resume).expanduser()


def check_resumed_data(config: SFTConfig, resume: str | bool | None, train_set: datasets.Dataset) -> None:
    """A resume's training data as built (tokenized, weighted, packed) has the checkpoint's rows; check_resume
    compared the settings before tokenizing."""
    if resume:
        check_same_data(resumed_checkpoint(Path(config.output_dir), resume), train_set)


def check_checkpoint(folder: Path, out: Path) -> None:
    """`folder` holds a checkpoint (is_resumable), not a run folder: the Trainer refuses a killed run's folder
    after loading the model, and "resumes" a finished run's from its final weights with a fresh optimizer."""
    if is_resumable(folder):
        return
    newest = get_last_checkpoint(str(folder))
    if newest:
        in_place = ("--resume_from_checkpoint true" if folder.resolve() == out.resolve()
                    else f"--output_dir {folder} --resume_from_checkpoint true")
        raise SFTError(f"resume_from_checkpoint: {folder} is a run folder, not a checkpoint. Resume from its newest "
                       f"checkpoint with --resume_from_checkpoint {newest}, or continue that run in its own folder "
                       f"with {in_place}.")
    raise SFTError(f"resume_from_checkpoint: {folder} holds no optimizer state and no checkpoint-N folder, so "
                   "training cannot resume exactly (optimizer and learning-rate schedule). To train on from its "
                   f"weights with a new optimizer and schedule, pass --model_name_or_path {folder} instead.")
