"""Collators that keep packed examples apart: padded [B, L] rows (PackedCollator) or one flattened row
(PaddingFreeCollator). Both find examples with sft.data.boundaries and never let a label be predicted across one.

Neither passes an attention_mask: transformers then derives a block-diagonal causal mask from the restarting
position_ids (see sft.data.packing and check_packing_supported for where that holds).
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

from sft.data.boundaries import long_tensor, row_positions, spans, starts
from sft.data.encode import IGNORE_INDEX
from sft.errors import SFTError
from sft.models.families import flattened_batches


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


def default_collator(tokenizer: PreTrainedTokenizerBase, args: Any) -> Any:
    """Batches for the recipe's layout; padding never hides a trained EOS (labels are padded with -100).

    Packed rows keep examples apart with restarting position_ids and no attention mask, one batch row per packed
    row (a [B, L] mask, not one quadratic [B*L]^2 mask), max_length wide under torch_compile; padding-free batches,
    and packed ones for flash or varlen attention (which need cu_seq_lens), get one flattened row
    (sft.models.families.flattened_batches).
    """
    # A plain TrainingArguments (the Trainer used from Python) has none of sft's layout fields: unpacked batches.
    packs = bool(getattr(args, "packing", False) or getattr(args, "eval_packing", False))
    if flattened_batches(getattr(args, "attn_implementation", None), getattr(args, "padding_free", False), packs):
        return PaddingFreeCollator()
    if packs:
        # Under torch_compile every packed batch is max_length wide: one shape, one graph. Padded to the longest row,
        # a batch of a new width recompiles the blocks mid-run (packed rows are nearly full: the padding is small).
        width = getattr(args, "max_length", None) if args.torch_compile else None
        return PackedCollator(tokenizer.pad_token_id, pad_to_multiple_of=width)
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)


def check_tokenized_rows(dataset: Any, name: str) -> None:
    """Refuse a dataset without the input_ids and labels columns the default collator batches (a torch Dataset or a
    streamed one whose columns are unknown passes)."""
    columns = getattr(dataset, "column_names", None)
    missing = [c for c in ("input_ids", "labels") if c not in columns] if isinstance(columns, list) else []
    if missing:
        raise SFTError(
            f"{name} has no {' or '.join(missing)} column (its columns: {', '.join(columns) or 'none'}): SFTTrainer "
            "trains tokenized rows, input_ids and labels (-100 where a token is not trained). Tokenize raw rows with "
            "sft.build_datasets(sft.load_recipe({'dataset': FILE, 'model_name_or_path': MODEL})), add labels (a copy "
            "of input_ids trains every token), or pass a data_collator that makes them.")
