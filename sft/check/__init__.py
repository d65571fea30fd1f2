"""Layer 6 — check: `sft check RECIPE [--prove]`, whether a recipe is correct, on CPU in seconds.

Owns: the smoke run on a tiny random model of the recipe's architecture (`smoke`) and the invariants sft's own tests
prove, proven on the recipe's own data, tokenizer and settings (`prove`: masks, packing, batching, resume, save/load,
sharded save, generation eval).
Must not import: sft.planning, sft.cli (same or higher layers).
"""
