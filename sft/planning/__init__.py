"""Layer 6 — planning: `sft plan`, whether a recipe fits, read from its model built on the meta device.

Owns: the byte formulas of each memory term (`memory`), the per-GPU breakdown, time estimate and verdict (`plan`),
the simulated step under FakeTensorMode that checks them (`memtrace`), the GPU kinds it knows (`hardware`).
Must not import: sft.check, sft.cli (same or higher layers).
"""
