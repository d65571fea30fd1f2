"""Benchmark sft's global packer against TRL-style best-fit-decreasing in 1000-row chunks on Alpaca data.

Usage: python scripts/bench_packing.py [--rows 20000] [--max_length 512] [--chunk 1000]
Needs ../shared/fixtures (the 1k Alpaca sample and the Mistral-7B-Instruct-v0.3 tokenizer folder).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import datasets
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import ALPACA as DATA  # noqa: E402
from bench import FIXTURES  # noqa: E402

from sft.data.bins import best_fit_decreasing, n_bins, pack_bins  # noqa: E402
from sft.data.encode import Encoding  # noqa: E402
from sft.data.formats import render_alpaca  # noqa: E402
from sft.data.packing import pack_dataset_with_stats  # noqa: E402

datasets.disable_progress_bars()
TOKENIZER = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.3"


def load_tokenized(rows: int, max_length: int, tokenizer=None) -> datasets.Dataset:
    """Alpaca rows replicated to `rows`, rendered with the Stanford templates, tokenized with labels (not truncated)
    by `tokenizer` (default: the TOKENIZER folder's)."""
    from transformers import AutoTokenizer

    records = json.loads(DATA.read_text(encoding="utf-8"))
    records = (records * -(-rows // len(records)))[:rows]
    rendered = [render_alpaca(r, str(DATA), i, completion_only=True) for i, r in enumerate(records)]
    # The packer truncates or splits, so tokenize without a cut: limit far above any Alpaca row.
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(TOKENIZER)
    enc = Encoding(tokenizer, max_length=max_length * 1000).encode(rendered)
    return datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "labels": enc["labels"]})


def timed(fn, *args, **kwargs):
    """(result, seconds)."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def chunked_bins(lengths: np.ndarray, max_length: int, chunk: int) -> int:
    """Bins used by exact BFD run separately on consecutive chunks of rows (what TRL's batched map does)."""
    return sum(n_bins(best_fit_decreasing(lengths[i:i + chunk], max_length)) for i in range(0, len(lengths), chunk))


def trl_row(ds: datasets.Dataset, max_length: int, chunk: int) -> tuple[str, int, float] | None:
    """TRL's own pack_dataset (BFD per map batch), if trl is installed: (label, packed rows, seconds)."""
    try:
        from trl import pack_dataset as trl_pack
    except ImportError:
        return None
    packed, seconds = timed(trl_pack, ds, max_length, "bfd", map_kwargs={"batch_size": chunk})
    return f"trl.pack_dataset bfd ({chunk}-row map batches)", len(packed), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=1000)
    args = parser.parse_args()
    missing = [str(p) for p in (DATA, TOKENIZER) if not p.exists()]
    if missing:
        sys.exit(f"bench_packing: fixtures not found: {', '.join(missing)} "
                 "(expected ../shared/fixtures beside the repository)")

    ds, tok_s = timed(load_tokenized, args.rows, args.max_length)
    lengths = np.minimum(np.array([len(x) for x in ds["input_ids"]]), args.max_length)
    tokens, width = int(lengths.sum()), args.max_length
    print(f"{len(ds):,} rows, {tokens:,} tokens after truncation to {width} "
          f"(tokenized in {tok_s:.1f}s; {int((lengths == width).sum())} rows at the limit)\n")

    (packed, stats), pack_s = timed(pack_dataset_with_stats, ds, width, "bfd")
    results = [
        ("sft pack_dataset (global BFD + exact-fit, dataset built)", stats.packed_rows, pack_s),
        ("sft global BFD only (packer)", *map_bins(timed(best_fit_decreasing, lengths, width))),
        ("sft global BFD + exact-fit (packer)", *map_bins(timed(pack_bins, lengths, width))),
        (f"BFD in {args.chunk}-row chunks (packer)", *timed(chunked_bins, lengths, width, args.chunk)),
    ]
    trl = trl_row(ds, width, args.chunk)
    if trl:
        results.append(trl)
    print_table(results, len(ds), tokens, width)


def map_bins(result: tuple[np.ndarray, float]) -> tuple[int, float]:
    """(bin count, seconds) from (bin ids, seconds)."""
    return n_bins(result[0]), result[1]


def print_table(results: list[tuple[str, int, float]], rows: int, tokens: int, width: int) -> None:
    """Rows, tokens, packed rows, efficiency (tokens / (packed rows x max_length)) and time per method."""
    name_w = max(len(name) for name, _, _ in results)
    print(f"{'method':<{name_w}}  {'rows':>7}  {'tokens':>10}  {'packed':>7}  {'efficiency':>10}  {'time':>8}")
    for name, packed_rows, seconds in results:
        print(f"{name:<{name_w}}  {rows:>7,}  {tokens:>10,}  {packed_rows:>7,}  "
              f"{tokens / (packed_rows * width):>10.3%}  {seconds:>7.3f}s")
    print(f"\nlower bound: {-(-tokens // width):,} rows (100% efficiency)")


if __name__ == "__main__":
    main()
