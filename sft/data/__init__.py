"""sft.data."""
