"""Layer 1 — the configuration every other layer reads: `SFTConfig` (`arguments`: transformers'
(Seq2Seq)TrainingArguments plus the model, data and SFT fields a recipe can set), the value checks on a built config
(`validate`) and the names recipe values may take (`names`, importable without torch for the command line).

Owns: the fields, their defaults and docstrings, and which combinations are invalid.
Must not import: any other sft package (only `sft.errors`). Reading recipe files and applying presets is
`sft.training.recipe`'s job, because presets need model facts.
"""
