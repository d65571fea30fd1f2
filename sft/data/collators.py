"""Collators that keep packed examples apart: padded [B, L] rows (PackedCollator) or one flattened row
(PaddingFreeCollator). Both find examples with sft.data.boundaries and never let a label be predicted across one.

Neither passes an attention_mask: transformers then derives a block-diagonal causal mask from the restarting
position_ids (see sft.data.packing and check_packing_supported for where that holds).
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from sft.data.boundaries import long_tensor, row_positions, spans, starts
from sft.data.encode import IGNORE_INDEX


def example_row(feature: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, labels and position_ids of one (packed or plain) row; example starts get label -100."""
    ids = long_tensor(feature["input_ids"])
    labels = feature.get("labels")
    labels = ids.clone() if labels is None else long_tensor(labels)  # a copy: we edit it
    pos = row_positions(feature, ids.numel())
    if not ids.numel() == labels.numel() == pos.numel():
        raise ValueError(f"row lengths disagree: input_ids {ids.numel()}, labels {labels.numel()}, "
                         f"positions {pos.numel()}")
    labels[starts(pos)] = IGNORE_INDEX  # nothing may be predicted across an example boundary
    return ids, labels, pos


@dataclass
class PackedCollator:
    """Packed rows as a [B, L] batch for eager / sdpa / flex attention: right-padded, no attention_mask.

    position_ids restart at every example (the padding is one more example), which transformers turns into a
    block-diagonal causal mask as long as attention_mask is None and no KV cache is built (use_cache=False).
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Collate rows into input_ids, labels and position_ids tensors of shape [B, L]."""
        rows = [example_row(f) for f in features]
        width = max(ids.numel() for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row_ids, row_labels, row_pos) in enumerate(rows):
            n = row_ids.numel()
            ids[i, :n], labels[i, :n], pos[i, :n] = row_ids, row_labels, row_pos
            pos[i, n:] = torch.arange(width - n)  # its own example: real tokens never attend to padding
        return {"input_ids": ids, "labels": labels, "position_ids": pos}


class PaddingFreeCollator(DataCollatorWithFlattening):
    """transformers' DataCollatorWithFlattening that also takes packed rows, split at their examples first.

    All examples of a batch become one [1, total] row with position_ids restarting per example; cu_seq_lens_q/k
    (int32) and max_length_q/k (int), on by default here, let flash attention run its varlen kernel. Eager / sdpa /
    flex derive a block-diagonal mask from the position_ids.
    """

    def __init__(self, return_flash_attn_kwargs: bool = True, **kwargs) -> None:
        super().__init__(return_flash_attn_kwargs=return_flash_attn_kwargs, **kwargs)

    def __call__(self, features: list[dict], return_tensors: str | None = None,
                 separator_id: int | None = None) -> dict[str, torch.Tensor | int]:
        """Collate rows into one flattened row (plus flash-attention boundary kwargs).

        For PyTorch tensors the batch is built with tensor ops, not the library's per-token Python lists (about 2.5x
        faster on 8 rows of 2048 tokens, scripts/bench_collate.py); its output is byte-identical to
        DataCollatorWithFlattening's on the same examples (tests/test_padding_free_collator.py).
        """
        rows = [example_row(feature) for feature in features]
        if (return_tensors or self.return_tensors) != "pt":
            examples = [{"input_ids": ids[a:b], "labels": labels[a:b]} for ids, labels, pos in rows
                        for a, b in spans(pos)]
            return super().__call__(examples, return_tensors, separator_id)
        return self._flatten(rows, self.separator_id if separator_id is None else separator_id)

    def _flatten(self, rows: list[tuple[torch.Tensor, ...]], separator_id: int) -> dict[str, torch.Tensor | int]:
        ids = torch.cat([r[0] for r in rows]) if rows else torch.zeros(0, dtype=torch.long)
        labels = torch.cat([r[1] for r in rows]) if rows else ids.clone()
        first = torch.cat([starts(r[2]) for r in rows]) if rows else ids.bool()  # each example's first token
        labels[first] = separator_id
        bounds = first.nonzero().flatten()
        lengths = torch.diff(bounds, append=torch.tensor([ids.numel()]))
        batch = {"input_ids": ids[None], "labels": labels[None]}
        if self.return_position_ids:
            offsets = torch.repeat_interleave(bounds, lengths)
            batch["position_ids"] = (torch.arange(ids.numel()) - offsets + self.position_ids_start)[None]
        if self.return_seq_idx:
            batch["seq_idx"] = torch.repeat_interleave(torch.arange(len(bounds), dtype=torch.int32), lengths)[None]
        if self.return_flash_attn_kwargs:
            cu_seq_lens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
            batch["cu_seq_lens_q"], batch["cu_seq_lens_k"] = cu_seq_lens, cu_seq_lens.clone()
            batch["max_length_q"] = batch["max_length_k"] = int(lengths.max()) if lengths.numel() else 0
        return batch


TRAINED_TARGETS = "trained_targets"


@dataclass
class HostCount:
    """Any collator, plus the batch's count of trained next-token targets (labels[:, 1:] != -100), counted on the
    host while the labels are still CPU tensors: `trained_targets` = (count, B, T) of those [B, T] targets.

    The chunked loss selects the trained positions with it at a size known in advance; counting them on the GPU
    would make the host wait for the device on every forward. Plain Python ints ride through accelerate's and the
    Trainer's device moves untouched.
    """

    collator: Any

    def __call__(self, features: list[dict]) -> Any:
        """The collator's batch, with `trained_targets` where it has [B, L] CPU labels."""
        batch = self.collator(features)
        labels = batch.get("labels") if hasattr(batch, "get") else None
        if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.device.type == "cpu":
            targets = labels[:, 1:]
            batch[TRAINED_TARGETS] = (int((targets != IGNORE_INDEX).sum()), *targets.shape)
        return batch
