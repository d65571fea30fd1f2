"""NEFTune noisy embeddings that scale by each example's own length, also inside packed rows.

transformers' hook draws noise with magnitude alpha / sqrt(row_length * d): under packing every example then gets
about sqrt(k) too little noise. Here each token's noise uses the length L_i of the example it belongs to,
alpha / sqrt(L_i * d), as in the NEFTune paper. Padding of padded batches gets none; the tail PackedCollator
appends to a packed row is one more example to the position ids and gets noise like one, which changes nothing:
it has no trained token and no real token attends to it.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from sft.data.boundaries import token_lengths


def token_example_lengths(inputs: dict[str, Any]) -> torch.Tensor:
    """[B, T] float tensor: for each token, the length of the example it belongs to (0 for a padded batch's
    padding).

    Packed and padding-free batches carry position_ids that restart at every example (read by
    sft.data.boundaries, as the attention mask is); padded batches carry an attention_mask.
    """
    if "position_ids" in inputs and "attention_mask" not in inputs:
        return token_lengths(inputs["position_ids"]).float()
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(inputs["input_ids"])
    return (mask.sum(dim=1, keepdim=True) * mask).float()


class NEFTune:
    """Attach / detach the per-example noise hook on a model's input embeddings."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.lengths: torch.Tensor | None = None  # set before each training forward
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def attach(self, embeddings: nn.Module) -> None:
        """Start adding noise to the embedding output in training mode."""
        self._handle = embeddings.register_forward_hook(self._hook)

    def detach(self) -> None:
        """Restore the plain embedding forward."""
        if self._handle is not None:
            self._handle.remove()
        self._handle, self.lengths = None, None

    @contextlib.contextmanager
    def attached(self, embeddings: nn.Module) -> Iterator["NEFTune"]:
        """The noise hook on `embeddings` for the duration of the block."""
        self.attach(embeddings)
        try:
            yield self
        finally:
            self.detach()

    def see(self, inputs: dict[str, Any]) -> None:
        """Take the example lengths of the batch the next training forward embeds."""
        self.lengths = token_example_lengths(inputs)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training or self.lengths is None or self.lengths.shape != output.shape[:2]:
            return output
        lengths = self.lengths.to(output.device)
        scale = self.alpha / torch.sqrt(lengths.clamp(min=1) * output.shape[-1])
        scale = torch.where(lengths > 0, scale, torch.zeros_like(scale)).to(output.dtype)
        noise = torch.empty_like(output).uniform_(-1.0, 1.0)
        return output + noise * scale.unsqueeze(-1)
