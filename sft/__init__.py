"""sft: supervised fine-tuning of language models from YAML recipes, on transformers.Trainer.

The package map (layers, lowest first; a layer imports only from layers below it — tests/test_layout.py):

    sft.errors, sft.rundir  0  the one user-facing exception; which files in an output folder are sft's
    sft.config              1  SFTConfig, the checks on its values, the names recipe values take
    sft.models              2  model facts (architectures, family capabilities), loading, adapters, quantization, merge
    sft.data                3  sources, formats, chat templates and masks, encoding, packing, statistics
    sft.evaluation          4  generation settings, generation-based evaluation, metrics
    sft.training            5  recipes and presets, the Trainer and its concerns, loss, checkpoints, train/eval flows
    sft.planning            6  `sft plan`: memory and time from the recipe's model on the meta device
    sft.check               6  `sft check [--prove]`: the recipe run on a tiny model of its architecture
    sft.cli                 7  the `sft` verbs

Importing `sft` is cheap and has no side effects: the names below load on first use.
"""

from typing import Any

__version__ = "0.1.0"

PUBLIC = {  # public name -> the module that owns it
    "SFTConfig": "sft.config.arguments",
    "SFTError": "sft.errors",
    "SFTTrainer": "sft.training.trainer",
    "Seq2SeqSFTTrainer": "sft.training.trainer",
    "build_datasets": "sft.data.build",
    "load_recipe": "sft.training.recipe",
    "train": "sft.training.flows",
}
__all__ = list(PUBLIC)


def __getattr__(name: str) -> Any:
    """`from sft import train` imports sft.training.flows only then (PEP 562)."""
    if name not in PUBLIC:
        raise AttributeError(f"module 'sft' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
