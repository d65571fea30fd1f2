"""Layer 5 — training: a recipe to a finished run.

Owns: recipe files and command-line overrides (`recipe`), the distributed presets (`presets`), the recipe catalog
and where shipped files live (`catalog`), the Trainer subclasses whose hooks delegate to one small object per
concern (loss, NEFTune, checkpoint staging, signals, divergence, throughput), the chunked loss (`loss`), and the
train/eval flows with what a run leaves behind (`flows`, `report`).
Must not import: sft.planning, sft.check, sft.cli.
"""
