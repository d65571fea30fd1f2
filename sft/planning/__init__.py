"""sft.planning."""
