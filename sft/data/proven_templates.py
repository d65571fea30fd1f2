"""Chat templates that passed `sft check --prove` on this machine: a cache file of template hashes (not a registry),
written by the proofs (sft.check.prove) and read by `sft train` to suggest --prove for a template not seen to pass."""

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def cache_file() -> Path:
    """$XDG_CACHE_HOME/sft/proven-templates (default ~/.cache): one template hash per line."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sft" / "proven-templates"


def template_hash(template: str) -> str:
    """The short hash a template is recorded (and named in the hint) by."""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def is_proven(template: str) -> bool:
    """Whether `template` passed the proofs on this machine."""
    path = cache_file()
    return path.is_file() and template_hash(template) in path.read_text().split()


def remember_template(template: str) -> None:
    """Record a template that passed every proof."""
    if is_proven(template):
        return
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(template_hash(template) + "\n")
    except OSError as err:  # a read-only home must not turn passed proofs into an error
        log.warning("Could not record the proven chat template in %s: %s", path, err)


def unproven_template_hint(template: str | None) -> str | None:
    """The one-line hint `sft train` logs for a chat template that has not passed `sft check --prove` here."""
    if not template or is_proven(template):
        return None
    return (f"This chat template ({template_hash(template)}) has not passed `sft check RECIPE --prove` on this "
            "machine: run it to prove masks, packing, batching, resume and saving on your data before a long run.")
