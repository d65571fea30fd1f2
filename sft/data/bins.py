"""Bin packing of example lengths into rows of max_length tokens: best-fit-decreasing (exact, vectorised per
distinct length) and exact-fit-decreasing on the length histogram; `pack_bins` keeps whichever needs fewer rows."""

from collections import defaultdict

import numpy as np

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
