"""sft.evaluation."""
