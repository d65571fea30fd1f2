"""Layer 1 — the configuration every other layer reads: `SFTConfig` (transformers' (Seq2Seq)TrainingArguments plus
the model, data and SFT fields a recipe can set) and the value checks on a built config.

Owns: the fields, their defaults and docstrings, and which combinations are invalid.
Must not import: any other sft package (only `sft.errors`). Reading recipe files and applying presets is
`sft.training.recipe`'s job, because presets need model facts.
"""

from sft.config.arguments import SFTConfig

__all__ = ["SFTConfig"]
