"""Throughput in the training logs: tokens per second since the last log and the running count of trained tokens,
over every process, and carried across a resume in the checkpoint's trainer_state.json."""

import time
from typing import Any, Callable

import torch

from sft.data.encode import IGNORE_INDEX
from sft.training.loss import loss_targets

STATE_KEY = "sft_trained_tokens"  # in TrainerState.stateful_callbacks, which every checkpoint saves
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over processes (accelerator.reduce); identity alone


class ThroughputLog:
    """Counts each micro-batch's tokens (attended; packed rows without their padding) and trained targets (the labels
    the loss scores: a causal LM's next-token targets when `shifted`, an encoder-decoder's labels) between logs."""

    def __init__(self, device: torch.device | str = "cpu", pad_token_id: int | None = None,
                 shifted: bool = True) -> None:
        self.device = device  # where a collective can sum the counts (NCCL: the GPU)
        self.pad_token_id = pad_token_id  # PackedCollator pads with it (packed_padding)
        self.shifted = shifted
        self.window_tokens, self.pending_trained, self.trained_total = 0, 0, 0
        self.window_start = time.perf_counter()

    def count(self, inputs: dict[str, Any]) -> None:
        """Add one micro-batch. The sums stay tensors on the batch's device until a log reads them: an int() here
        would wait for the GPU on every micro-step."""
        mask = inputs.get("attention_mask")
        self.window_tokens += (mask.sum() if mask is not None
                               else inputs["input_ids"].numel() - packed_padding(inputs, self.pad_token_id))
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor):  # a user's collator may give labels None (DataCollatorForSeq2Seq)
            # A row's first label is no causal target: counted, a user's labels = input_ids logged one trained token
            # per row more than the loss trains (40 vs 36); sft's own rows never train their first label.
            self.pending_trained += (loss_targets(labels, self.shifted) != IGNORE_INDEX).sum()

    def add_to(self, logs: dict[str, float], reduce: Reduce = lambda t: t) -> dict[str, float]:
        """Training logs (those with a loss) plus tokens_per_second and trained_tokens of all processes; starts a
        new window. Every process logs at the same steps, so the sum over them (one collective) is safe here."""
        if "loss" not in logs:
            return logs
        window, trained = (int(n) for n in reduce(torch.stack([self._tensor(self.window_tokens),
                                                               self._tensor(self.pending_trained)])))
        self.trained_total += trained
        now = time.perf_counter()
        rate = window / max(now - self.window_start, 1e-9)
        self.window_tokens, self.pending_trained, self.window_start = 0, 0, now
        return {**logs, "tokens_per_second": round(rate, 1), "trained_tokens": self.trained_total}

    def save_to(self, stateful: dict, reduce: Reduce = lambda t: t) -> None:
        """Put the trained-token count so far (all processes) into the state a checkpoint saves."""
        self.trained_total += int(reduce(self._tensor(self.pending_trained)))
        self.pending_trained = 0
        stateful[STATE_KEY] = {"trained_tokens": self.trained_total}

    def resume_from(self, stateful: dict) -> None:
        """Go on counting from a checkpoint's count (0 for checkpoints written before it was saved)."""
        self.trained_total = stateful.get(STATE_KEY, {}).get("trained_tokens", 0)

    def _tensor(self, count: int | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(count, dtype=torch.int64, device=self.device)


def packed_padding(inputs: dict[str, Any], pad_token_id: int | None) -> torch.Tensor | int:
    """The padding tokens of a PackedCollator batch (no attention_mask): each row's padding is one more example at
    its end (positions from 0) of pad ids and no labels; a real example always has a token that is not padding or
    a label. Tensor ops on the batch's device: no wait for the GPU."""
    ids, positions, labels = inputs["input_ids"], inputs.get("position_ids"), inputs.get("labels")
    if pad_token_id is None or positions is None or labels is None or ids.dim() != 2 or ids.shape[0] == 1:
        return 0  # one row (padding-free, or a single packed row) is as wide as itself: no padding
    index = torch.arange(ids.shape[1], device=ids.device)
    last = index >= torch.where(positions == 0, index, 0).amax(dim=1, keepdim=True)  # each row's last example
    padded = ~(last & ((ids != pad_token_id) | (labels != IGNORE_INDEX))).any(dim=1)
    return (last.sum(dim=1) * padded).sum()
