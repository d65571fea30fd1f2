"""Packing: tokenized examples packed into rows of max_length tokens (bins from sft.data.bins), their stats, and
which models keep packed examples apart (the collators are in sft.data.collators).

Isolation of packed examples relies on transformers' packed-sequence detection (masking_utils,
`find_packed_sequence_indices`): when a model is called with restarting `position_ids`, `attention_mask=None`
and no KV cache (`use_cache=False`), eager / sdpa / flex build a block-diagonal causal mask, and flash
attention switches to its varlen kernel for a single flattened row. `check_packing_supported` encodes where
that holds.
"""

from dataclasses import asdict, dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable
from transformers import PreTrainedConfig

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
