"""Throughput in the training logs: tokens per second since the last log and the running count of trained tokens."""

import time
from typing import Any

from sft.data.encode import IGNORE_INDEX


class ThroughputLog:
    """Counts each micro-batch's tokens (attended, or all without a mask) and trained labels between logs."""

    def __init__(self) -> None:
        self.window_tokens, self.trained_total, self.window_start = 0, 0, time.perf_counter()

    def count(self, inputs: dict[str, Any]) -> None:
        """Add one micro-batch. The sums stay tensors on the batch's device until a log reads them: an int() here
        would wait for the GPU on every micro-step."""
        mask = inputs.get("attention_mask")
        self.window_tokens += mask.sum() if mask is not None else inputs["input_ids"].numel()
        if "labels" in inputs:
            self.trained_total += (inputs["labels"] != IGNORE_INDEX).sum()

    def add_to(self, logs: dict[str, float]) -> dict[str, float]:
        """Training logs (those with a loss) plus tokens_per_second and trained_tokens; starts a new window."""
        if "loss" not in logs:
            return logs
        now = time.perf_counter()
        rate = int(self.window_tokens) / max(now - self.window_start, 1e-9)
        self.window_tokens, self.window_start = 0, now
        return {**logs, "tokens_per_second": round(rate, 1), "trained_tokens": int(self.trained_total)}
