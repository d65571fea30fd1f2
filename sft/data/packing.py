"""Packing: a global best-fit-decreasing packer, packed datasets, and collators that keep packed examples apart.

Isolation of packed examples relies on transformers' packed-sequence detection (masking_utils,
`find_packed_sequence_indices`): when a model is called with restarting `position_ids`, `attention_mask=None`
and no KV cache (`use_cache=False`), eager / sdpa / flex build a block-diagonal causal mask, and flash
attention switches to its varlen kernel for a single flattened row. `check_packing_supported` encodes where
that holds.
"""

from collections import defaultdict
from dataclasses import asdict, dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable
from transformers import PreTrainedConfig

from sft.data.encode import IGNORE_INDEX

STRATEGIES = ("bfd", "bfd_split")


# ---------------------------------------------------------------------------------------------------------------
# Best-fit-decreasing over the whole dataset
# ---------------------------------------------------------------------------------------------------------------

class _OpenBins:
    """Open bins indexed by remaining capacity: counts per capacity and stacks of bin-id chunks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.count = np.zeros(capacity + 1, dtype=np.int64)
        self.chunks: dict[int, list[np.ndarray]] = defaultdict(list)
        self.n_bins = 0

    def fitting(self, size: int) -> np.ndarray:
        """Remaining capacities >= size that hold open bins, smallest first."""
        return np.flatnonzero(self.count[size:]) + size

    def take(self, cap: int, n: int) -> np.ndarray:
        """Remove n bins of remaining capacity cap (which ones is irrelevant: equal capacities are interchangeable)."""
        stack, got = self.chunks[cap], []
        while n > 0:
            top = stack[-1]
            if len(top) <= n:
                got.append(stack.pop())
            else:
                got.append(top[len(top) - n:])
                stack[-1] = top[:len(top) - n]
            n -= len(got[-1])
        self.count[cap] -= sum(len(g) for g in got)
        return got[0] if len(got) == 1 else np.concatenate(got)

    def put(self, cap: int, ids: np.ndarray) -> None:
        """Add bins with remaining capacity cap; full bins are dropped since nothing fits them any more."""
        if cap > 0 and len(ids):
            self.chunks[cap].append(ids)
            self.count[cap] += len(ids)

    def new(self, n: int) -> np.ndarray:
        """Ids of n freshly opened (empty) bins."""
        ids = np.arange(self.n_bins, self.n_bins + n, dtype=np.int64)
        self.n_bins += n
        return ids

    def fill(self, bins: np.ndarray, cap: int, size: int, k: int) -> np.ndarray:
        """Put up to k items of one size into bins of capacity cap, each taking as many as fit; returns bin per item.

        Under BFD a bin that just received an item is the tightest fit for the next item of the same size
        (its capacity dropped below every other candidate), so it keeps receiving them until they stop fitting.
        """
        per_bin = cap // size
        used = min(k, len(bins) * per_bin)
        full, rest = divmod(used, per_bin)
        self.put(cap - per_bin * size, bins[:full])
        if rest:
            self.put(cap - rest * size, bins[full:full + 1])
        return np.repeat(bins, per_bin)[:used]


def _place_group(bins: _OpenBins, size: int, k: int) -> np.ndarray:
    """Best-fit k items of one size, one capacity level at a time; returns the bin of each item in order."""
    out = []
    for cap in bins.fitting(size).tolist():
        n = min(int(bins.count[cap]), -(-k // (cap // size)))
        out.append(bins.fill(bins.take(cap, n), cap, size, k))
        k -= len(out[-1])
        if k == 0:
            return np.concatenate(out)
    per_new = bins.capacity // size
    out.append(bins.fill(bins.new(-(-k // per_new)), bins.capacity, size, k))
    return np.concatenate(out)


def _check_lengths(lengths: np.ndarray, max_length: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if lengths.size and (lengths.min() < 1 or lengths.max() > max_length):
        raise ValueError(f"item lengths must lie in [1, {max_length}]; got [{lengths.min()}, {lengths.max()}] "
                         "(truncate or split over-long examples and drop empty ones first)")
    return lengths


def _argsort_lengths(keys: np.ndarray, max_length: int) -> np.ndarray:
    """Stable argsort of small non-negative keys; 16-bit keys let numpy use its radix sort."""
    return np.argsort(keys.astype(np.uint16) if max_length < 2**16 else keys, kind="stable")


def best_fit_decreasing(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Bin id of each item under exact best-fit-decreasing with bins of capacity max_length."""
    lengths = _check_lengths(lengths, max_length)
    order = _argsort_lengths(max_length - lengths, max_length)  # decreasing length, stable
    counts = np.bincount(lengths, minlength=max_length + 1)
    bins, assigned, start = _OpenBins(max_length), np.empty(lengths.size, dtype=np.int64), 0
    # Python work is per distinct length x capacity level touched; items are assigned in numpy slices
    for size in np.flatnonzero(counts)[::-1].tolist():
        k = int(counts[size])
        assigned[start:start + k] = _place_group(bins, size, k)
        start += k
    bin_of = np.empty_like(assigned)
    bin_of[order] = assigned
    return bin_of


# ---------------------------------------------------------------------------------------------------------------
# Exact-fit decreasing: bin patterns on the length histogram
# ---------------------------------------------------------------------------------------------------------------

def _reachable(counts: np.ndarray, capacity: int) -> np.ndarray:
    """reach[v] is True when v is a sum of available lengths (repetition allowed); a Python-int bitset."""
    reach, mask = 1, (1 << (capacity + 1)) - 1
    for size in np.flatnonzero(counts).tolist():
        step = size
        while step <= capacity:  # doubling shifts allow 0..2^k-1 copies with k shifts
            reach = (reach | (reach << step)) & mask
            step *= 2
    raw = np.frombuffer(reach.to_bytes(capacity // 8 + 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:capacity + 1].astype(bool)


def _fill(rest: int, counts: np.ndarray, reach: np.ndarray) -> tuple[list[tuple[int, int]], int]:
    """Fill a gap from counts (updated in place): the largest length whose remainder stays fillable, in as many
    copies as keep it so; plain best fit once no exact completion exists. Returns [(size, copies)], slack."""
    picks = []
    while rest > 0:
        avail = counts[1:rest + 1] > 0
        exact = avail & reach[rest - 1::-1]  # reach[rest - size] for size = 1..rest
        pool = exact if exact.any() else avail
        if not pool.any():
            break
        size = int(np.flatnonzero(pool)[-1]) + 1
        copies = np.arange(min(int(counts[size]), rest // size), 0, -1)  # most copies first
        if pool is exact:
            copies = copies[reach[rest - copies * size]]  # non-empty: one copy leaves a fillable remainder
        picks.append((size, int(copies[0])))
        counts[size] -= copies[0]
        rest -= int(copies[0]) * size
    return picks, rest


def _pattern(counts: np.ndarray, reach: np.ndarray, capacity: int) -> tuple[dict[int, int], int]:
    """One bin: the largest remaining item plus the greedy exact fill of its gap; returns {size: copies}, slack."""
    largest = int(np.flatnonzero(counts)[-1])
    trial = counts.copy()
    trial[largest] -= 1
    picks, slack = _fill(capacity - largest, trial, reach)
    pattern = {largest: 1}
    for size, n in picks:
        pattern[size] = pattern.get(size, 0) + n
    return pattern, slack


def _patterns(counts: np.ndarray, capacity: int) -> list[tuple[dict[int, int], int]]:
    """Bin patterns with multiplicities: each pattern is reused while its items last, so the Python work is per
    pattern, not per bin."""
    counts, out = counts.copy(), []
    reach, reach_avail = _reachable(counts, capacity), int(np.count_nonzero(counts))
    while counts.any():
        pattern, slack = _pattern(counts, reach, capacity)
        avail = int(np.count_nonzero(counts))
        # Lengths that ran out leave reach stale (too optimistic). A refresh costs ~distinct lengths x capacity bit
        # operations: cheap histograms refresh at every change, big ones after a share of their lengths ran out
        if slack and reach_avail - avail >= max(1, min(reach_avail // 32, reach_avail * capacity >> 18)):
            reach, reach_avail = _reachable(counts, capacity), avail
            pattern, slack = _pattern(counts, reach, capacity)
        copies = min(int(counts[size]) // n for size, n in pattern.items())
        for size, n in pattern.items():
            counts[size] -= copies * n
        out.append((pattern, copies))
    return out


def _assign(lengths: np.ndarray, patterns: list[tuple[dict[int, int], int]], max_length: int) -> np.ndarray:
    """Bin id of each item from bin patterns: items of one length fill that length's slots in bin order."""
    slots: dict[int, list[np.ndarray]] = {}
    first = 0
    for pattern, copies in patterns:
        ids = np.arange(first, first + copies, dtype=np.int64)
        for size, n in pattern.items():
            slots.setdefault(size, []).append(np.repeat(ids, n))
        first += copies
    bin_of = np.empty(lengths.size, dtype=np.int64)
    bin_of[_argsort_lengths(lengths, max_length)] = np.concatenate([a for size in sorted(slots) for a in slots[size]])
    return bin_of


def exact_fit_decreasing(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Bin id of each item: bins opened largest item first, their gap filled to exactly max_length where possible.

    Works on the histogram of lengths (equal lengths are interchangeable), so the Python work grows with the
    number of distinct bin patterns, not with the number of items.
    """
    lengths = _check_lengths(lengths, max_length)
    if lengths.size == 0:
        return np.empty(0, dtype=np.int64)
    return _assign(lengths, _patterns(np.bincount(lengths, minlength=max_length + 1), max_length), max_length)


def n_bins(bin_of: np.ndarray) -> int:
    """Number of bins in a bin-id-per-item assignment."""
    return int(bin_of.max()) + 1 if bin_of.size else 0


def pack_bins(lengths: np.ndarray, max_length: int, exact_fit: bool = True) -> np.ndarray:
    """Bin id of each item: best-fit-decreasing, or exact-fit-decreasing when enabled and it needs fewer bins."""
    bfd = best_fit_decreasing(lengths, max_length)
    if not exact_fit:
        return bfd
    efd = exact_fit_decreasing(lengths, max_length)
    return efd if n_bins(efd) < n_bins(bfd) else bfd  # never worse than BFD


def pack_lengths(lengths: np.ndarray, max_length: int, exact_fit: bool = True) -> list[np.ndarray]:
    """Item indices of each bin (bins of capacity max_length), from `pack_bins`."""
    bin_of = pack_bins(lengths, max_length, exact_fit)
    order = np.argsort(bin_of, kind="stable")
    return np.split(order, np.cumsum(np.bincount(bin_of))[:-1]) if bin_of.size else []


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
    first = np.cumsum(lengths) - lengths  # where each segment begins in the output
    position = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(first, lengths)
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


# ---------------------------------------------------------------------------------------------------------------
# Collators
# ---------------------------------------------------------------------------------------------------------------

def _positions(seq_lengths: np.ndarray) -> np.ndarray:
    """Position of each token within its example, for consecutive examples of the given lengths."""
    first = np.cumsum(seq_lengths) - seq_lengths
    return np.arange(int(seq_lengths.sum()), dtype=np.int64) - np.repeat(first, seq_lengths)


def _row(feature: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, labels and position_ids of one (packed or plain) row; example starts get label -100."""
    ids = np.asarray(feature["input_ids"], dtype=np.int64)
    labels = feature.get("labels")
    labels = ids.copy() if labels is None else np.array(labels, dtype=np.int64)  # copy: we edit it
    if feature.get("position_ids") is not None:  # Trainer may drop seq_lengths (remove_unused_columns)
        pos = np.asarray(feature["position_ids"], dtype=np.int64)
    elif feature.get("seq_lengths") is not None:
        pos = _positions(np.asarray(feature["seq_lengths"], dtype=np.int64))
    else:
        pos = np.arange(ids.size, dtype=np.int64)
    if not ids.size == labels.size == pos.size:
        raise ValueError(f"row lengths disagree: input_ids {ids.size}, labels {labels.size}, positions {pos.size}")
    labels[_starts(pos)] = IGNORE_INDEX  # nothing may be predicted across an example boundary
    return ids, labels, pos


def _starts(pos: np.ndarray) -> np.ndarray:
    """Example starts as transformers sees them: the first token and wherever positions do not go up by 1."""
    return np.diff(pos, prepend=pos[:1]) != 1  # the prepended copy makes the first diff 0: a start


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
        rows = [_row(f) for f in features]
        width = max(ids.size for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((len(rows), width), dtype=np.int64)
        for i, (row_ids, row_labels, row_pos) in enumerate(rows):
            n = row_ids.size
            ids[i, :n], labels[i, :n], pos[i, :n] = row_ids, row_labels, row_pos
            pos[i, n:] = np.arange(width - n)  # its own segment: real tokens never attend to padding
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}


@dataclass
class PaddingFreeCollator:
    """All examples of a batch flattened into one [1, total] row, like DataCollatorWithFlattening.

    Works for plain rows (padding_free) and packed rows (split at their example boundaries). position_ids restart
    per example; with return_flash_attn_kwargs, cu_seq_lens_q/k (int32) and max_length_q/k (int) let flash
    attention run its varlen kernel. Eager / sdpa / flex derive a block-diagonal mask from the position_ids.
    """

    return_flash_attn_kwargs: bool = True

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor | int]:
        """Collate rows into one flattened row (plus flash-attention boundary kwargs)."""
        rows = [_row(f) for f in features]
        ids, labels, pos = (np.concatenate(parts) for parts in zip(*rows))
        batch: dict[str, torch.Tensor | int] = {"input_ids": torch.from_numpy(ids)[None],
                                                "labels": torch.from_numpy(labels)[None],
                                                "position_ids": torch.from_numpy(pos)[None]}
        if self.return_flash_attn_kwargs:
            starts = np.concatenate([_starts(p) for _, _, p in rows])  # a row never continues the previous one
            cu = torch.from_numpy(np.append(np.flatnonzero(starts), ids.size).astype(np.int32))
            longest = int(torch.diff(cu).max()) if ids.size else 0
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch


# ---------------------------------------------------------------------------------------------------------------
# Which models and attention implementations keep packed examples apart
# ---------------------------------------------------------------------------------------------------------------

# Decoders that hand position_ids to transformers' mask builders (create_causal_mask & co.), so restarting
# positions isolate packed examples. Each one is checked on a tiny model by tests/test_packing.py; add a
# model_type here only with such a check.
PACKING_MODEL_TYPES: set[str] = {
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "gpt_neox", "gpt2", "gpt_bigcode", "gptj", "codegen", "starcoder2", "olmo2",
    "olmo3", "granite", "granitemoe", "cohere", "cohere2", "stablelm", "smollm3", "glm4", "exaone4", "llama4_text",
}
# Families that build their causal mask without position_ids (several also add ALiBi from the attention mask):
# packed examples would attend to each other.
NO_PACKING_MODEL_TYPES: set[str] = {"opt", "bloom", "mpt", "falcon", "gpt_oss"}
MASK_ATTENTION = ("eager", "sdpa", "flex_attention")  # block-diagonal mask from position_ids, any batch size


def check_packing_supported(model_config: PreTrainedConfig, attn_implementation: str | None = None,
                            flattened: bool = False) -> None:
    """Raise ValueError unless the model family and attention implementation keep packed examples apart.

    flattened: the batch is one row (PaddingFreeCollator), which flash attention needs to see the boundaries.
    Either way the model must run with use_cache=False and without an attention_mask.
    """
    model_type = getattr(model_config, "model_type", None)
    attn = attn_implementation or getattr(model_config, "_attn_implementation", None) or "sdpa"
    if model_type in NO_PACKING_MODEL_TYPES:
        raise ValueError(f"Packing is not supported for {model_type} models: they build the attention mask without "
                         "position_ids, so packed examples would attend to each other. Set packing: false.")
    if model_type not in PACKING_MODEL_TYPES:
        raise ValueError(f"Packing / padding-free training is not verified for model_type {model_type!r}: its "
                         "attention might let packed examples see each other. Verified families: "
                         f"{', '.join(sorted(PACKING_MODEL_TYPES))}. Set packing: false and padding_free: false.")
    if attn in MASK_ATTENTION:
        return
    if "flash" in attn and "paged" not in attn:  # paged attention serves generation, not training batches
        if not flattened:
            raise ValueError(f"{attn} separates packed examples only in a single flattened row: use padding_free "
                             "(PaddingFreeCollator, which passes cu_seq_lens) or attn_implementation sdpa.")
        return
    raise ValueError(f"attn_implementation {attn!r} cannot isolate packed examples; use one of "
                     f"{', '.join(MASK_ATTENTION)} (or flash attention with padding_free).")
