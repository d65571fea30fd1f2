"""Output folders sft owns: a manifest (sft_run.json) names what sft wrote, so sft only ever replaces its own files.

A folder is an sft run when it holds the manifest. An entry is sft's when the manifest lists it with the size and
content hash sft left it with (a file a user edited afterwards, e.g. the model card README.md, is the user's
again). A training run records each checkpoint folder as it moves it into place; the staging folder of a save a kill
interrupted and the Trainer's TensorBoard logs (runs/) are its own unlisted, and so is what a kill between writing
and renaming a staged file (write_staged) left. Everything else is foreign: sft refuses to write into a folder holding
foreign entries and never deletes them.

The process that writes a training run's files holds a lock in its folder (hold) for the whole run, so a second run
into the same folder is refused while the first still writes there.
"""

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TextIO

from sft.errors import SFTError

log = logging.getLogger(__name__)

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
# Held (flock) by the process writing a run's files: never foreign, recorded or removed by another run's overwrite.
LOCK = ".sft_run.lock"
STAGING = ".tmp"  # write_staged writes NAME.tmp whole, then renames it to NAME
# What a run has in flight, never uploaded with its folder: its lock, a checkpoint or file being staged.
IN_FLIGHT = [LOCK, ".staging-*", f"*{STAGING}"]
PREDICTIONS = "predictions.jsonl"  # generation predictions, staged; PREFIX_predictions.jsonl for other than eval
# What a kill between writing and renaming a staged file leaves: sft's, not every *.tmp (a user's notes.tmp is theirs).
STAGED = re.compile(rf"({re.escape(MANIFEST)}|(\w+_)?{re.escape(PREDICTIONS)}){re.escape(STAGING)}")
_held: dict[Path, tuple[TextIO, bool]] = {}  # the run folders this process locked: their lock file, created or not


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
    """What `folder` holds, less another process's writability probe and a run's lock (never the user's, never sft's to
    record)."""
    return [p for p in folder.iterdir() if not p.name.startswith(WRITE_PROBE) and p.name != LOCK]


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


def hold(out: Path, key: str = "output_dir") -> None:
    """Lock `out` (created if new) for this process until release(out); refuse it while another sft run holds it (a
    second job with the same output_dir; a killed launcher's workers, which live on in their own sessions). The OS
    drops the lock when its process dies, so a killed run never blocks its own resume."""
    folder = out.resolve()
    if folder in _held:
        return
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        handle = _lock(folder / LOCK)
    except BlockingIOError:
        raise _busy(out, key) from None
    except OSError as err:  # a file system without locks (some NFS mounts): the run goes on unprotected, as before
        log.warning("%s %s cannot be locked against another sft run writing there at once (%s).", key, out, err)
        return
    handle.truncate(0)
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    handle.flush()
    _held[folder] = handle, created


def _lock(path: Path) -> TextIO:
    """The file at `path` (created if new), opened and locked by this process; BlockingIOError while another holds
    it. The file must still be the one at `path` once locked: a holder removes it on release, maybe after this opened
    it, and another run may have locked the new one since."""
    while True:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open until release)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        except OSError:
            handle.close()
            raise
        handle.close()


def release(out: Path) -> None:
    """Drop this process's lock on `out` (hold), and the folder when hold created it and nothing was written."""
    folder = out.resolve()
    if folder not in _held:
        return
    handle, created = _held.pop(folder)
    (folder / LOCK).unlink(missing_ok=True)  # while still held: no other run can have locked this file
    handle.close()
    if created and not any(folder.iterdir()):
        folder.rmdir()  # a run refused before it wrote anything leaves no folder behind


def _busy(out: Path, key: str) -> SFTError:
    """The refusal of a folder another sft run holds, naming that run's process."""
    try:
        holder = json.loads((out / LOCK).read_text(encoding="utf-8"))
        who = f" (pid {holder['pid']} on {holder['host']})"
    except (OSError, ValueError, KeyError, TypeError):  # not written yet: the holder has only just locked it
        who = ""
    return SFTError(f"{key} {out} is being written by another sft run{who}, still running. Wait for it to end or stop "
                    f"it (a launcher killed alone leaves its workers running), or choose another {key}.")
