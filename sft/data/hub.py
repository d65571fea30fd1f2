"""Hub dataset ids: read with `datasets`; with the Hub unreachable, from the datasets cache, else from the snapshot
that `hf download --repo-type dataset NAME` left in the huggingface_hub cache, which `datasets` does not read."""

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import datasets
import huggingface_hub
import huggingface_hub.constants

from sft.data.files import COMPRESSED, file_kind
from sft.errors import SFTError
from sft.models.hub import hub_offline, hub_reachable
from sft.models.loading import looks_local

log = logging.getLogger(__name__)
# How sft reads a local folder (sources._load_local): folder, split, README `configs` name -> rows
FolderReader = Callable[[Path, str, str | None], datasets.Dataset]


class Source(Protocol):
    """What is read here of a sources.Source (which imports this module)."""

    path: str
    split: str
    name: str | None
    data_dir: str | None

    @property
    def label(self) -> str: ...


def load_hub(source: Source, read_folder: FolderReader) -> datasets.Dataset:
    """The Hub dataset `source` names, with `datasets` (only its cache when the Hub is unreachable, without
    retries), else its snapshot in the huggingface_hub cache, read by `read_folder` as the Hub's own files."""
    check_reachable(source)
    online = hub_reachable()
    try:
        with contextlib.nullcontext() if online else hub_offline():  # the cache only: no retries
            return datasets.load_dataset(source.path, source.name, data_dir=source.data_dir, split=source.split)
    except Exception as err:
        if online:
            raise SFTError(f"Could not load dataset {source.label} from the Hub: {first_line(err)}. Check the id and "
                           "split, your network, and `huggingface-cli login` for gated data.") from None
        why = first_line(err)
    snapshot = cached_snapshot(source.path)
    if snapshot is None:
        raise SFTError(f"Could not load dataset {source.label}: the Hugging Face Hub cannot be reached (no network, or "
                       f"HF_HUB_OFFLINE is set) and the datasets cache ({datasets.config.HF_DATASETS_CACHE}) does not "
                       f"hold it ({why}), nor does the Hub cache ({huggingface_hub.constants.HF_HUB_CACHE}, where `hf "
                       f"download --repo-type dataset {source.path}` puts it). Point `dataset` at a local file or "
                       "folder, or load it once where the Hub is reachable.")
    log.info("Dataset %s: the Hub cannot be reached; reading its files downloaded to %s.", source.label, snapshot)
    # the repository's files as the Hub serves them: README `configs`, split files and data_dir read as datasets would
    return read_folder(snapshot / source.data_dir if source.data_dir else snapshot, source.split, source.name)


def cached_snapshot(repo_id: str) -> Path | None:
    """The folder of Hub dataset `repo_id`'s files in the huggingface_hub cache (its main revision), or None."""
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a valid repository id
        return None


def check_reachable(source: Source) -> None:
    """A path-looking source that is not on disk is a typo, not a Hub id."""
    if looks_local(source.path) or file_kind(Path(source.path)) or Path(source.path).suffix in COMPRESSED:
        raise SFTError(f"Dataset file {source.path} does not exist. Check the path (relative paths start from "
                       f"{Path.cwd()}).")


def first_line(err: Exception) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
