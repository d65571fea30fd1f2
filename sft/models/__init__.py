"""sft.models."""
