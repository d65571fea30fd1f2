"""Output folders sft owns: a manifest (sft_run.json) names what sft wrote, so sft only ever replaces its own files.

A folder is an sft run when it holds the manifest. An entry is sft's when the manifest lists it with the size and
content hash sft left it with (a file a user edited afterwards, e.g. the model card README.md, is the user's
again). A training run records each checkpoint folder as it moves it into place; the staging folder of a save a kill
interrupted and the Trainer's TensorBoard logs (runs/) are its own unlisted, and so is what a kill between writing
and renaming a staged file (write_staged) left. Everything else is foreign: sft refuses to write into a folder holding
foreign entries and never deletes them.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from sft.errors import SFTError

MANIFEST = "sft_run.json"
# The Trainer's checkpoint folders, sft's staging ones and TensorBoard logs: sft's in a marked folder even when a
# killed run never listed them.
CHECKPOINT_NAME = re.compile(r"(checkpoint-\d+|\.staging-\d+|runs)$")  # what a training run writes beside its files
# Of those, what a training run leaves unlisted: a save's staging folder (a kill mid-save), the Trainer's logs. A
# checkpoint-N is listed as it is moved into place; an unlisted one is the user's (a model they put there was deleted).
UNLISTED = re.compile(r"(\.staging-\d+|runs)$")
SHOWN = 8  # foreign names listed in a refusal
HASHED_BYTES = 16 * 2**20  # larger files (weights) are identified by size alone: hashing them costs seconds
# A training run's recipe, which `sft train` records before any checkpoint: a manifest listing it marks a training
# run. `sft eval` and `sft merge` mark the folders they write to as well, which may be a user's own Trainer output.
RECIPE = "recipe.yaml"
DATA_STATS = "data_stats.json"  # a run's data statistics; its `formats` say which prompt the model learnt
# `writable`'s probe: every rank of a launch checks output_dir, so another rank's probe can be there for a moment.
WRITE_PROBE = ".sft-write-test-"
STAGING = ".tmp"  # write_staged writes NAME.tmp whole, then renames it to NAME
PREDICTIONS = "predictions.jsonl"  # generation predictions, staged; PREFIX_predictions.jsonl for other than eval
# What a kill between writing and renaming a staged file leaves: sft's, not every *.tmp (a user's notes.tmp is theirs).
STAGED = re.compile(rf"({re.escape(MANIFEST)}|(\w+_)?{re.escape(PREDICTIONS)}){re.escape(STAGING)}")


def _stamp(path: Path) -> list | None:
    """What identifies a file's content: its size, and the hash of files up to HASHED_BYTES (recipes, results, the
    model card). Not the modification time, so a copied or synced run folder is still sft's. Folders: by name."""
    if path.is_dir():
        return None
    size = path.stat().st_size
    return [size, hashlib.sha256(path.read_bytes()).hexdigest() if size <= HASHED_BYTES else None]


def read_manifest(out: Path) -> dict[str, list[int] | None] | None:
    """The entries sft recorded in `out`, or None when `out` is not an sft run."""
    try:
        return json.loads((out / MANIFEST).read_text(encoding="utf-8"))["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def entries(folder: Path) -> list[Path]:
    """What `folder` holds, less another process's writability probe (never the user's, never sft's to record)."""
    return [p for p in folder.iterdir() if not p.name.startswith(WRITE_PROBE)]


def foreign_entries(out: Path) -> list[str]:
    """Names in `out` that sft did not write (or that changed since it did)."""
    if not out.is_dir():
        return []
    owned = read_manifest(out)
    if owned is None:
        return sorted(p.name for p in entries(out) if not STAGED.fullmatch(p.name))
    trained = RECIPE in owned  # runs/ beside an eval's or merge's files is the user's (their own Trainer's)
    return sorted(p.name for p in entries(out) if p.name != MANIFEST and not STAGED.fullmatch(p.name) and not (
        (p.name in owned and owned[p.name] == _stamp(p)) or (trained and p.is_dir() and UNLISTED.match(p.name))))


def describe(names: list[str]) -> str:
    """A short list of names for a one-line message."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_writable(out: Path, key: str = "output_dir") -> None:
    """`out` is a folder, or can be made one, that this user may write to."""
    if out.exists() and not out.is_dir():
        raise SFTError(f"{key} {out} is a file, not a folder. Choose a folder path for the run.")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise SFTError(f"{key} {out} cannot be created: {existing} is a file. Choose a folder path for the run.")
    if not writable(existing):
        raise SFTError(f"{key} {out} is not writable ({existing} does not allow writing). Choose a folder you can "
                       "write to.")


def writable(folder: Path) -> bool:
    """Whether a folder can be created in `folder`: permission bits say nothing to root or on read-only mounts."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=WRITE_PROBE, dir=folder))
    except OSError:
        return False
    return True


def check_output_dir(out: Path, key: str = "output_dir") -> None:
    """`out` can hold a run: new, empty or an earlier sft run without foreign files, and writable."""
    foreign = foreign_entries(out)
    if foreign:  # checked before the writability probe, which would touch the folder's mtime
        raise SFTError(f"{key} {out} holds files sft did not write (or that changed since): {describe(foreign)}. "
                       f"sft writes only into a new or empty folder or an earlier sft run; move those files or choose "
                       f"another {key}.")
    check_writable(out, key)


def is_run(out: Path) -> bool:
    """Whether `out` holds an sft run."""
    return read_manifest(out) is not None


def claim(out: Path, names: list[str] | None = None, folders: tuple[str, ...] = ()) -> None:
    """Record `names` (default: every entry of `out`) as written by sft, keeping earlier records. `folders` are
    recorded before they exist (folders are known by name): a checkpoint about to be renamed into place, so a kill
    between the rename and the record cannot leave it foreign."""
    recorded = read_manifest(out) or {}
    for name in names if names is not None else [p.name for p in entries(out)]:
        if name != MANIFEST and not STAGED.fullmatch(name) and (out / name).exists():
            recorded[name] = _stamp(out / name)
    recorded.update(dict.fromkeys(folders))
    write_staged(out / MANIFEST, json.dumps({"written_by": "sft", "entries": recorded}, indent=1) + "\n")


def write_staged(path: Path, text: str) -> None:
    """Write `path` whole under a staging name, then rename it into place: a kill never leaves it half-written (and
    what it leaves under the staging name is sft's, STAGED)."""
    staging = path.with_name(path.name + STAGING)
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)


def clear_run(out: Path) -> list[str]:
    """Delete what an earlier sft run wrote in `out` (only that: foreign files make it refuse); returns the names."""
    foreign = foreign_entries(out)
    if foreign:  # checked before any work too; a file a user added since must still survive
        raise SFTError(f"output_dir {out} holds files sft did not write: {describe(foreign)}; nothing was removed.")
    removed = sorted(p.name for p in entries(out)) if out.is_dir() else []
    for name in removed:
        path = out / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return removed


def run_file(folder: Path, name: str) -> Path | None:
    """The file `name` of the run `folder` is, or is a checkpoint-N of, or None: a checkpoint lacks what a run writes
    at its end (data_stats.json; generation_config.json of an adapter checkpoint saved by earlier versions)."""
    folder = Path(folder)
    run = folder.parent if re.fullmatch(r"checkpoint-\d+", folder.name) else folder
    return next((candidate / name for candidate in (folder, run) if (candidate / name).is_file()), None)

