"""Where packed examples start and end: the one reading of position_ids that sft shares with transformers.

Packed rows (pack_dataset), flattened padding-free batches and the padding PackedCollator appends all number
positions from 0 in every example. transformers' packed-sequence detection (masking_utils,
`find_packed_sequence_indices`) starts a new sequence wherever position_ids do not go up by 1, and flash
attention's varlen kernel gets the same boundaries as cu_seq_lens. The collators' label masking, NEFTune's
per-example noise, the eval prompt cutting and `sft check`'s packing proof read boundaries here, by that same rule,
so none of them can disagree with the attention mask the model builds.
"""

import numpy as np
import torch


def positions(lengths: np.ndarray) -> np.ndarray:
    """position_ids of consecutive examples of the given lengths: 0, 1, ... restarting at every example."""
    lengths = np.asarray(lengths, dtype=np.int64)
    first = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(first, lengths)


def long_tensor(values: object) -> torch.Tensor:
    """A new int64 tensor of `values` (a list, numpy array or tensor), through numpy: torch.tensor on a Python list
    of 2048 ints takes ~0.1 ms, numpy ~0.03 ms, and collators convert three lists per row on every batch."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.long, copy=True)
    return torch.from_numpy(np.array(values, dtype=np.int64))


def row_positions(feature: dict, n_tokens: int) -> torch.Tensor:
    """position_ids of one dataset row: its own, else from its seq_lengths, else the row is one example."""
    if feature.get("position_ids") is not None:  # Trainer may drop seq_lengths (remove_unused_columns)
        return long_tensor(feature["position_ids"])
    if feature.get("seq_lengths") is not None:
        return torch.from_numpy(positions(feature["seq_lengths"]))
    return torch.arange(n_tokens, dtype=torch.long)


def starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where an example starts ([..., T]): each row's first token and wherever positions do not go up by 1."""
    out = torch.ones_like(position_ids, dtype=torch.bool)
    out[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return out


def spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each example in one row of position_ids."""
    bounds = starts(position_ids).nonzero().flatten().tolist() + [position_ids.shape[-1]]
    return list(zip(bounds[:-1], bounds[1:]))


def token_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """For each token of a [B, T] batch, the length of the example it belongs to.

    Counted into a buffer of one slot per token (there are never more examples than tokens), not with bincount,
    whose output size depends on the data: on a GPU that makes the host wait for the device (NEFTune runs this on
    every training micro-step).
    """
    example = torch.cumsum(starts(position_ids).flatten(), 0) - 1  # one id per example across the batch
    counts = torch.zeros_like(example).index_add_(0, example, torch.ones_like(example))
    return counts[example].view_as(position_ids)
