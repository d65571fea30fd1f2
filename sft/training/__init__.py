"""sft.training."""
