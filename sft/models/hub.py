"""Whether the Hugging Face Hub can be reached, decided once per process.

Lookups that have an offline answer (a model's config or generation config, `sft check`'s tokenizer) read local
files and the HF cache first; only when that fails do they ask the Hub, and only if it answers. Without this an
offline machine pays huggingface_hub's retries (about 23 s per file, with a warning per retry) for every lookup
before the fallback is reached: `sft check` of a Hub recipe took 76 s offline instead of 7.
"""

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
from huggingface_hub.utils import get_session

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0


@functools.cache
def hub_reachable() -> bool:
    """False in offline mode (HF_HUB_OFFLINE) or when the Hub endpoint (HF_ENDPOINT) does not answer within a few
    seconds; the answer holds for the rest of the process."""
    if huggingface_hub.constants.is_offline_mode():
        return False
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as err:  # any transport failure (DNS, refused, timeout, proxy) means the same: no Hub
        log.warning("The Hugging Face Hub (%s) cannot be reached (%s): using local files and the HF cache only. "
                    "Set HF_HUB_OFFLINE=1 to skip this check.", endpoint, str(err).splitlines()[0] if str(err) else
                    type(err).__name__)
        return False
    return True


def local_files_only(name: str | Path) -> bool:
    """from_pretrained's `local_files_only` for `name`: True (read the HF cache only, no retries) when it is not a
    local folder and the Hub cannot be reached. A local folder never probes the Hub."""
    return not Path(name).expanduser().exists() and not hub_reachable()


def model_hub_kwargs(name: str | Path) -> dict:
    """A model from_pretrained's `local_files_only` for `name`, given to its adapter_config.json probe too:
    transformers (5.24) hands that probe the revision but not local_files_only, so loading a cached Hub model with
    the Hub unreachable paid huggingface_hub's retries anyway (23 s, 10 warnings, in each `sft train` and `sft
    generate`)."""
    local = local_files_only(name)
    return {"local_files_only": local, **({"adapter_kwargs": {"local_files_only": True}} if local else {})}


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """`datasets` and huggingface_hub in offline mode for the block, as HF_HUB_OFFLINE=1 sets it: Hub datasets come
    from the datasets cache. `datasets` has no per-call switch (DownloadConfig(local_files_only=True) still asks
    the Hub), so an unreachable Hub cost about 23 s of retries per dataset, a warning each, before failing."""
    import datasets.config

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def push_problem(push_to_hub: bool, hub_model_id: str | None, output_dir: str) -> str | None:
    """Why a run asking for push_to_hub could not push, or None. Decided before any data or model is loaded: the
    Trainer creates the repository when it is built, after tokenizing and loading the model, and without a Hub that
    failed there with a traceback (exit 1); a Hub lost later failed the final save, after all of training."""
    if not push_to_hub or hub_reachable():
        return None
    repo = hub_model_id or Path(output_dir).absolute().name  # the repository the Trainer would create
    why = ("HF_HUB_OFFLINE is set" if huggingface_hub.constants.is_offline_mode()
           else f"{huggingface_hub.constants.ENDPOINT} does not answer")
    return (f"push_to_hub: true, but the Hugging Face Hub cannot be reached ({why}), so the run could not create or "
            f"push to {repo}. Train with --push_to_hub false and upload the finished run later with "
            f"`hf upload {repo} {output_dir}`, or run where the Hub is reachable.")


@contextlib.contextmanager
def uploads_skipping(patterns: list[str]) -> Iterator[None]:
    """transformers.Trainer's folder uploads (through transformers.trainer.hf_api, its one Hub client) also skip
    `patterns`: its checkpoint push skips `_*` and `checkpoint-*` only."""
    import transformers.trainer

    client = transformers.trainer.hf_api
    transformers.trainer.hf_api = lambda: SkippingUploads(client(), patterns)
    try:
        yield
    finally:
        transformers.trainer.hf_api = client


class SkippingUploads:
    """A Hub client whose upload_folder also skips `patterns`; every other call goes to `client` unchanged."""

    def __init__(self, client: object, patterns: list[str]) -> None:
        self.client, self.patterns = client, patterns

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)

    def upload_folder(self, *, ignore_patterns: list[str] | str | None = None, **kwargs: object) -> object:
        given = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
        return self.client.upload_folder(ignore_patterns=given + self.patterns, **kwargs)
