"""Where the GPU waited on the host, from a Chrome trace of `scripts/bench.py --trace DIR` (torch.profiler, CUDA and
host operators): the time between kernels, and what the host was running meanwhile.

    python scripts/trace_gaps.py docs/benchmarks/<device-date>/traces/qwen2.5-0.5b-full-sft-varlen-compile.json.gz

A gap is the time from the end of one GPU activity (kernel, copy, memset; any stream) to the start of the next,
over `--min_us`. Each gap is charged to the outermost host operator running at its midpoint (`ProfilerStep`-like
annotations and the Trainer's own are outer operators too), or to the CUDA runtime call there (a
`cudaStreamSynchronize` is the host waiting for the GPU, not the other way round), else to "(no host op)". The
table sums the gaps by what was running and lists the longest. The profiled steps carry the profiler's own host
overhead (more with host operators recorded), so the totals are an upper bound on a timed step's idle time.
"""

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return [e for e in trace.get("traceEvents", trace) if e.get("ph") == "X" and "dur" in e]


def gaps(events: list[dict], min_us: float) -> list[tuple[float, float]]:
    """(start, end) in µs of every stretch over `min_us` with no GPU activity on any stream."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_KINDS)
    out, busy_until = [], None
    for start, end in spans:
        if busy_until is not None and start - busy_until > min_us:
            out.append((busy_until, start))
        busy_until = end if busy_until is None else max(busy_until, end)
    return out


HOST_KINDS = ("cpu_op", "user_annotation", "python_function")
RUNTIME_KINDS = ("cuda_runtime", "cuda_driver")


class Outermost:
    """The outermost events of some kinds on each host thread (an event inside another on its thread is dropped),
    to find what ran at a moment with a bisection per thread."""

    def __init__(self, events: list[dict], kinds: tuple[str, ...]) -> None:
        threads = defaultdict(list)
        for e in sorted((e for e in events if e.get("cat") in kinds), key=lambda e: (e["ts"], -e["dur"])):
            top = threads[(e.get("pid"), e.get("tid"))]
            if not top or e["ts"] >= top[-1]["ts"] + top[-1]["dur"]:
                top.append(e)
        self.threads = [(top, [e["ts"] for e in top]) for top in threads.values()]

    def at(self, moment: float) -> dict | None:
        """The longest outermost event running at `moment` on any thread."""
        found = []
        for top, starts in self.threads:
            i = bisect.bisect_right(starts, moment) - 1
            if i >= 0 and moment <= top[i]["ts"] + top[i]["dur"]:
                found.append(top[i])
        return max(found, key=lambda e: e["dur"]) if found else None


def running_at(host: Outermost, runtime: Outermost, moment: float) -> str:
    """The outermost host operator (or else CUDA runtime call) running at `moment`."""
    event = host.at(moment) or runtime.at(moment)
    return event["name"] if event else "(no host op)"


def analyse(events: list[dict], min_us: float) -> dict:
    """Busy and idle µs over the traced span, the idle by what the host ran, and the gaps longest first."""
    gpu = [e for e in events if e.get("cat") in GPU_KINDS]
    if not gpu:
        return {"gpu_events": 0}
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    host, runtime = Outermost(events, HOST_KINDS), Outermost(events, RUNTIME_KINDS)
    found = [(start, end, running_at(host, runtime, (start + end) / 2)) for start, end in gaps(events, min_us)]
    by_host = defaultdict(lambda: [0.0, 0])
    for start, end, name in found:
        by_host[name][0] += end - start
        by_host[name][1] += 1
    return {"gpu_events": len(gpu), "span_us": span, "idle_us": sum(end - start for start, end, _ in found),
            "by_host": sorted(((name, us, n) for name, (us, n) in by_host.items()), key=lambda row: -row[1]),
            "longest": sorted(found, key=lambda gap: gap[0] - gap[1])[:15], "t0": min(e["ts"] for e in gpu)}


def report(result: dict) -> str:
    if not result["gpu_events"]:
        return "no GPU activity in this trace (a CPU run, or a trace without CUDA events)"
    lines = [f"GPU span {result['span_us'] / 1e3:.1f} ms, idle in gaps {result['idle_us'] / 1e3:.1f} ms "
             f"({100 * result['idle_us'] / result['span_us']:.1f}%)", "", f"{'host running':<60} {'idle ms':>8} gaps"]
    lines += [f"{name[:60]:<60} {us / 1e3:>8.2f} {n:>4}" for name, us, n in result["by_host"][:20]]
    lines += ["", f"{'at ms':>8} {'gap ms':>7}  host running"]
    lines += [f"{(start - result['t0']) / 1e3:>8.2f} {(end - start) / 1e3:>7.2f}  {name[:80]}"
              for start, end, name in result["longest"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz)")
    parser.add_argument("--min_us", type=float, default=20.0, help="shortest gap counted (default 20 µs)")
    args = parser.parse_args(argv)
    if not args.trace.exists():
        sys.exit(f"{args.trace}: no such file")
    print(report(analyse(load(args.trace), args.min_us)))


if __name__ == "__main__":
    main()
