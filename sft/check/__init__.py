"""sft.check."""
