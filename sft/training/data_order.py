"""What decides which rows each optimizer step trains, recorded with every checkpoint and compared on resume.

The Trainer resumes by skipping as many batches as the checkpoint's steps took, in the order this run draws them:
that is the checkpoint's rows only when the rows and their order are the same. The order comes from the sampler's
seed (data_seed, else seed) and train_sampling_strategy; the rows from the training data as sft builds it: its files,
tokenized within max_length, weighted and held out with seed, and packed (packing, with seed). With any of them
changed a resumed run trained other rows than the run it continues, some twice and some never, without a word.
Checkpoints from before sft recorded it (no ORDER_KEY) are not checked.
"""

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sft.errors import SFTError

log = logging.getLogger(__name__)
ORDER_KEY = "sft_data_order"  # in TrainerState.stateful_callbacks, beside checkpoints.BATCH_KEY
SETTINGS = ("seed", "data_seed", "packing", "packing_strategy", "max_length", "train_sampling_strategy")  # refused
PACKING_ONLY = ("packing_strategy",)  # decides nothing without packing: recorded as None then, never compared
# The same rows in the same order, laid out otherwise in a batch (one flattened row): warned, not refused.
LAYOUT = ("padding_free",)
SAMPLED_ROWS = 64  # rows whose tokens and labels the content digest reads, spread over the dataset


def data_order(args: Any, dataset: Any) -> dict[str, Any]:
    """The record of a run's data order: its SETTINGS and LAYOUT, and of a datasets.Dataset its row count, content
    digest and datasets fingerprint (a Trainer used from Python may be given another kind of dataset)."""
    order = {name: _setting(args, name) for name in (*SETTINGS, *LAYOUT)}
    if isinstance(dataset, datasets.Dataset):
        order.update(rows=len(dataset), content=content_digest(dataset), fingerprint=dataset._fingerprint)
    return order


def _setting(args: Any, name: str) -> Any:
    if name in PACKING_ONLY and not getattr(args, "packing", False):
        return None
    value = getattr(args, name, None)  # TrainingArguments have no packing, max_length or padding_free
    return getattr(value, "value", value)  # an enum as the value a recipe gives


def content_digest(dataset: datasets.Dataset) -> str:
    """A hash of every row's length, in order, and of the tokens and labels of up to SAMPLED_ROWS rows spread over
    the dataset: it reads one integer per row and a few rows (not the tokens of gigabytes of data), and changes with
    rows added, removed, re-ordered, cut otherwise or packed otherwise."""
    digest = hashlib.sha256()
    for column in [_row_lengths(dataset), *_sampled_rows(dataset)]:
        digest.update(np.asarray(column, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _row_lengths(dataset: datasets.Dataset) -> np.ndarray:
    """Every row's length: sft's tokenized data has a `length` column; packed rows are read as lists (offsets). Read
    from the whole table through the row selection: datasets' own read of a selection took 2.2 s for 1M rows (at
    every checkpoint), this 3 ms."""
    name = "length" if "length" in dataset.column_names else "input_ids"
    column = dataset.data.column(name)
    lengths = (column if pa.types.is_integer(column.type) else pc.list_value_length(column)).to_numpy()
    selection = dataset._indices  # the rows a select() kept, or None
    return lengths if selection is None else lengths[selection.column(0).to_numpy()]


def _sampled_rows(dataset: datasets.Dataset) -> list[pa.Array]:
    """The tokens and labels of SAMPLED_ROWS rows at even spacing, flattened."""
    names = [name for name in ("input_ids", "labels") if name in dataset.column_names]
    rows = np.unique(np.linspace(0, len(dataset) - 1, min(len(dataset), SAMPLED_ROWS)).astype(np.int64))
    table = dataset.select(rows).select_columns(names).with_format("arrow")[:]
    return [pc.list_flatten(table.column(name)) for name in names]


def saved_order(folder: Path) -> dict[str, Any] | None:
    """The data order checkpoint `folder` recorded; None for one saved before sft recorded it."""
    state = json.loads((folder / "trainer_state.json").read_text() or "{}")
    return (state.get("stateful_callbacks") or {}).get(ORDER_KEY) or None


def check_same_settings(folder: Path, args: Any) -> None:
    """Refuse a resume whose SETTINGS differ from the checkpoint's; warn where a LAYOUT setting does. Needs no data:
    sft train calls it before tokenizing."""
    saved = saved_order(folder)
    if saved is None:
        return
    now = {name: _setting(args, name) for name in (*SETTINGS, *LAYOUT)}
    for name in LAYOUT:
        if name in saved and saved[name] != now[name]:
            log.warning("Resuming %s with %s %s; it was trained with %s. The same rows are trained in the same order, "
                        "laid out otherwise in each batch, so the run will not equal the uninterrupted one bit for "
                        "bit.", folder, name, _shown(now[name]), _shown(saved[name]))
    changed = [name for name in SETTINGS if name in saved and saved[name] != now[name]]
    if "packing" in changed:  # packing itself is the change to undo; its strategy goes with it
        changed = [name for name in changed if name not in PACKING_ONLY]
    if changed:
        changes = ", ".join(f"{name} {_shown(saved[name])} -> {_shown(now[name])}" for name in changed)
        restore = " ".join(f"--{name} {_shown(saved[name])}" if saved[name] is not None else f"without --{name}"
                           for name in changed)
        raise SFTError(f"resume_from_checkpoint: {folder} was trained with other settings that decide which rows each "
                       f"step trains ({changes}). {_WHY} Resume with {restore}, or start a new run from its weights "
                       f"with --model_name_or_path {folder}.")


def check_same_data(folder: Path, dataset: datasets.Dataset) -> None:
    """Refuse a resume whose training data, as built (tokenized, weighted, packed), has other rows than the
    checkpoint's: another row count or content digest. Where only the datasets fingerprint differs the rows read
    the same (a same-length edit is possible; so are a moved or touched file and another sft version): a warning."""
    saved = saved_order(folder)
    if saved is None or "rows" not in saved:
        return
    now = data_order(None, dataset)
    if (saved["rows"], saved["content"]) != (now["rows"], now["content"]):
        rows = (f"{saved['rows']} rows -> {now['rows']} rows" if saved["rows"] != now["rows"]
                else f"{now['rows']} rows, other content")
        raise SFTError(f"resume_from_checkpoint: {folder} was trained on other training data than this run builds "
                       f"({rows}: the dataset files, sources, weights or tokenizer differ). {_WHY} Resume with the "
                       "data it was trained on, or start a new run from its weights with --model_name_or_path "
                       f"{folder}.")
    if saved.get("fingerprint") != now["fingerprint"]:
        log.warning("Resuming %s: its training data was built from other inputs (fingerprint %s -> %s: a moved, "
                    "touched or edited dataset file, or another sft version), though its %d rows have the same lengths "
                    "and sampled tokens. Make sure it is the data the run was trained on.", folder,
                    saved.get("fingerprint"), now["fingerprint"], now["rows"])


_WHY = ("The Trainer skips the rows already trained by counting steps, so the resumed run would train other rows than "
        "the run it continues: some twice, some never.")


def _shown(value: Any) -> str:
    """A setting as a recipe or the command line gives it."""
    return str(value).lower() if isinstance(value, bool) else "unset" if value is None else str(value)
