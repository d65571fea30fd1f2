"""Packing: tokenized examples packed into rows of max_length tokens (bins from sft.data.bins) and their stats (the
collators are in sft.data.collators).

Isolation of packed examples relies on transformers' packed-sequence detection (masking_utils,
`find_packed_sequence_indices`): when a model is called with restarting `position_ids`, `attention_mask=None`
and no KV cache (`use_cache=False`), eager / sdpa / flex build a block-diagonal causal mask, and flash
attention switches to its varlen kernel for a single flattened row. Which model families and attention
implementations that holds for is sft.models.families.check_packing_supported's.
"""

from dataclasses import asdict, dataclass
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable

from sft.data.bins import n_bins, pack_bins
from sft.data.boundaries import positions
from sft.data.encode import IGNORE_INDEX

STRATEGIES = ("bfd", "bfd_split")


# ---------------------------------------------------------------------------------------------------------------
# Packed datasets
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class PackingStats:
    """What packing did: rows in and out, tokens kept, and how full the packed rows are."""

    rows: int
    examples: int  # after truncation or splitting
    truncated_rows: int
    split_rows: int
    dropped_tokens: int  # cut off by "bfd" truncation
    tokens: int
    packed_rows: int
    max_length: int
    packing_efficiency: float  # tokens / (packed_rows x max_length)

    def as_dict(self) -> dict:
        """JSON-ready mapping."""
        return asdict(self)


@dataclass
class _Segments:
    """Examples after truncation/splitting, as (start, length) slices of the flat token arrays."""

    start: np.ndarray
    length: np.ndarray


def _segments(lengths: np.ndarray, max_length: int, strategy: str) -> _Segments:
    """Slices of each row: its first max_length tokens ("bfd") or consecutive max_length chunks ("bfd_split")."""
    if strategy not in STRATEGIES:
        raise ValueError(f"packing strategy must be one of {STRATEGIES}, got {strategy!r}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    keep = lengths > 0  # empty rows carry nothing to pack
    starts, lengths = starts[keep], lengths[keep]
    if strategy == "bfd":
        return _Segments(starts, np.minimum(lengths, max_length))
    chunks = -(-lengths // max_length)
    row = np.repeat(np.arange(lengths.size), chunks)
    nth = np.arange(row.size) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # chunk index within its row
    offset = nth * max_length
    return _Segments(starts[row] + offset, np.minimum(lengths[row] - offset, max_length))


def _stats(lengths: np.ndarray, seg: _Segments, n_rows: int, max_length: int, strategy: str) -> PackingStats:
    """PackingStats of rows of `lengths` cut into `seg` and packed into n_rows rows."""
    tokens, over = int(seg.length.sum()), int((lengths > max_length).sum())
    return PackingStats(rows=int(lengths.size), examples=int(seg.length.size),
                        truncated_rows=over if strategy == "bfd" else 0,
                        split_rows=over if strategy == "bfd_split" else 0,
                        dropped_tokens=int(lengths.sum()) - tokens, tokens=tokens, packed_rows=n_rows,
                        max_length=max_length, packing_efficiency=tokens / (n_rows * max_length) if n_rows else 0.0)


def estimate_packing(lengths: np.ndarray, max_length: int, strategy: str = "bfd") -> PackingStats:
    """Packing stats from example lengths alone (no tokens are moved); what pack_dataset would produce."""
    lengths = np.asarray(lengths, dtype=np.int64)
    seg = _segments(lengths, max_length, strategy)
    return _stats(lengths, seg, n_bins(pack_bins(seg.length, max_length)), max_length, strategy)


def _token_index(seg: _Segments, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat token indices of the segments in `order`, and each token's position within its segment."""
    lengths = seg.length[order]
    position = positions(lengths)
    return np.repeat(seg.start[order], lengths) + position, position


def _list_array(values: np.ndarray, counts: np.ndarray) -> pa.Array:
    """Arrow list array of consecutive runs of `values` with the given run lengths (large offsets if needed)."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    cls = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    return cls.from_arrays(pa.array(offsets, pa.int32() if cls is pa.ListArray else pa.int64()), pa.array(values))


def _row_lengths(table: pa.Table, name: str) -> np.ndarray:
    """Length of every row's list in a column."""
    return pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)


def _flat_column(table: pa.Table, name: str) -> np.ndarray:
    """All values of a list column, concatenated (respects slicing offsets)."""
    return pc.list_flatten(table.column(name)).to_numpy()


def _packed_table(table: pa.Table, seg: _Segments, row_of: np.ndarray, n_rows: int) -> pa.Table:
    """The packed columns: segments gathered into their output rows (dataset order within a row)."""
    order = np.argsort(row_of, kind="stable")
    index, position = _token_index(seg, order)
    labels = _flat_column(table, "labels")[index]
    labels[position == 0] = IGNORE_INDEX  # also the first label of every split-off chunk
    row_tokens = np.bincount(row_of, weights=seg.length, minlength=n_rows).astype(np.int64)
    return pa.table({
        "input_ids": _list_array(_flat_column(table, "input_ids")[index], row_tokens),
        "labels": _list_array(labels, row_tokens),
        "position_ids": _list_array(position.astype(np.int32), row_tokens),
        "seq_lengths": _list_array(seg.length[order].astype(np.int32), np.bincount(row_of, minlength=n_rows)),
    })


def pack_dataset_with_stats(ds: datasets.Dataset, max_length: int, strategy: str = "bfd",
                            seed: int = 0) -> tuple[datasets.Dataset, PackingStats]:
    """Pack a tokenized dataset (input_ids, labels) into rows of at most max_length tokens; also the stats.

    Output columns: input_ids, labels, position_ids (restarting at 0 per example) and seq_lengths. Each example's
    first label is -100 so no token is trained on a prediction from the previous example. Rows are shuffled
    with `seed` so that rows of similar content (e.g. many short examples) do not cluster.
    """
    table = ds.select_columns(["input_ids", "labels"]).with_format("arrow")[:]  # honours any row selection
    lengths = _row_lengths(table, "input_ids")
    if not np.array_equal(lengths, _row_lengths(table, "labels")):
        raise ValueError("input_ids and labels differ in length in some rows; cannot pack them")
    seg = _segments(lengths, max_length, strategy)
    bin_of = pack_bins(seg.length, max_length)
    n_rows = n_bins(bin_of)
    row_of = np.random.default_rng(seed).permutation(n_rows)[bin_of]  # shuffled output row of each segment
    packed = _packed_table(table, seg, row_of, n_rows)
    # An explicit fingerprint: otherwise datasets hashes the whole table by pickling it (seconds per million rows)
    fingerprint = Hasher.hash(("sft.data.packing", ds._fingerprint, max_length, strategy, seed))
    return (datasets.Dataset(InMemoryTable(packed), fingerprint=fingerprint),
            _stats(lengths, seg, n_rows, max_length, strategy))


def pack_dataset(ds: datasets.Dataset, max_length: int, strategy: str = "bfd", seed: int = 0) -> datasets.Dataset:
    """Pack a tokenized dataset into rows of at most max_length tokens (see pack_dataset_with_stats)."""
    return pack_dataset_with_stats(ds, max_length, strategy, seed)[0]


def packed_as_asked(dataset: Any, args: Any, train: bool) -> Any:
    """`dataset` packed as `args` ask (SFTConfig packing for training, eval_packing for evaluation), unless it is
    packed already (position_ids: sft.train() packs before it builds the Trainer) or not a datasets.Dataset."""
    asked = getattr(args, "packing", False) if train else getattr(args, "packs_eval", False)
    if not asked or not isinstance(dataset, datasets.Dataset) or "position_ids" in dataset.column_names:
        return dataset
    return pack_dataset(dataset, args.max_length, args.packing_strategy, args.seed)
