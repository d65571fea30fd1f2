"""Layer 4 — evaluation: generation settings and generation-based evaluation.

Owns: the one builder of greedy generation configs (stopping on sft.data's stop tokens), generate() for
`sft generate`/`sft chat`, prompts cut out of eval batches and batched generation (`predict`), and the metrics
(exact match, ROUGE, BLEU, user functions).
Must not import: sft.training, sft.planning, sft.check, sft.cli.
"""
