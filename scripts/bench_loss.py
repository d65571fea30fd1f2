"""Issue 19: the LM head + loss alone, forward + backward, at the issue-19 shapes: sft's chunked linear-cross-entropy
against Liger's fused linear cross-entropy and the plain full-logits loss, with each one's exactness.

    python scripts/bench_loss.py --small                          # CPU, fp32, shrunk shapes: checks that it runs
    python scripts/bench_loss.py --json $OUT/loss.json            # CUDA: bf16 at the real shapes

Shapes: hidden size and vocabulary of Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B (sft/models/architectures.py
`known_config`; Qwen2.5 at the config's 151,936 rows, the issue-19 runs use its tokenizer's 151,665), 8 x 2048
tokens, the first (1 - fraction) of every row untrained (a masked prompt). --small: hidden / 8, vocabulary / 16,
4 x 256 tokens, fp32. Each variant gets the same random hidden states, head weight and targets (seed 0):

- chunked: what SFTTrainer runs, sft.training.linear_cross_entropy.LinearCrossEntropy at the trained rows.
- chunked-128rows: the same with 128 rows per chunk, sft's chunk before 2026-11-26 (32 MB of fp32 logits at big
  vocabularies; now 256 MB). Each chunk adds its bf16 weight-gradient product into the fp32 gradient ([vocab,
  hidden] written in bf16, read, cast, added: about 20 bytes per weight), a cost per chunk, not per row: on CPU
  (fp32, Qwen2.5-0.5B shape, 2048 trained rows) 128-row chunks took 60.7 s, 512-row 46.5 s, 2048-row 45.5 s.
- chunked-4x: the same with 4x the rows per chunk (1 GB of fp32 logits per chunk).
- chunked-cast-add: `chunked` with each chunk's weight-gradient product written in bf16, read, cast and added into
  the fp32 gradient, as sft did before 2026-11-27 and still does on CPU
  (sft.training.linear_cross_entropy.add_weight_grad now has cuBLAS accumulate it in fp32 on CUDA: addmm with
  out_dtype). On the H100 (Llama-3.2-1B head, 8 x 2048 rows) that
  took the loss from 70 to 50 ms at 50% trained, 137 to 98 ms at 100% (BENCHMARKS.md).
- chunked-unpadded: `chunked` without the padded copy sft makes of a head whose rows are not 16-byte aligned
  (sft.training.linear_cross_entropy.aligned_head; with --vocab 151665, Qwen2.5's tokenizer size: cuBLAS ran such a
  head's matmuls on sm75 align1 kernels, 61.5 of 122 ms of an H100 Qwen2.5-0.5B step's matmuls). The same as
  `chunked` otherwise.
- chunked-fused: what `loss_kernel: fused` runs: `chunked` with each chunk's logits-to-gradient step
  (sft.training.linear_cross_entropy.fused_logit_gradients) compiled by inductor with dynamic rows, so the float32
  logits' eager passes (cast, max, exp, sum, divide, cast back: ~46 bytes a logit) become reads of the 16-bit logits
  in fused loops (~8 bytes); compile time in the first warm-up, not the median.
- chunked-fused-4x: chunked-fused with 4x the rows per chunk: the float32 [vocabulary, hidden] weight-gradient
  accumulator is read and written once a chunk (1.09 GB at Qwen2.5's head, about 0.36 ms on an H100: more than the
  chunk's 0.15 ms of weight-gradient FLOPs), so fewer chunks move less; the fused step holds 4 bytes a logit, not 6.
- chunked-compiled (only when named in --variants): `chunked` under torch.compile (compile time is reported apart,
  not in the median). Dynamo unrolls the chunk loop: compile time grows with the chunks (on 2 CPU cores 23 s for 8
  chunks, 47 s for 32), and the issue-19 shapes have 64 to 128 (128 rows each), so it is opt-in.
- liger: what `loss_kernel: liger` runs, sft.training.loss.liger_loss: Liger's fused linear cross-entropy at the
  trained rows, reduction sum / sft's normaliser, fp32 weight-gradient accumulation. CUDA with liger-kernel only.
- liger-all: Liger as TRL calls it: every row, ignore_index -100, Liger's default accumulation (the weight's dtype).
- full-logits: the plain Trainer's way: hidden @ weight.T for every row, upcast to fp32, F.cross_entropy.

Per variant: median milliseconds of forward + backward (--repeats, after 2 warm-ups; GPU synchronised), peak
memory above the inputs (torch.cuda.max_memory_allocated during the variant minus what was allocated before it:
the variant's logits, workspaces and gradients; not measured on CPU), and exactness against an fp32 reference
(plain autograd over fp32 copies of the same inputs, chunk by chunk): |loss - reference| and, for the hidden and
weight gradients, max |grad - reference| / max |reference|; the JSON also has the graphs torch.compile built
and its graph breaks (0 for the eager variants). A variant that fails is recorded with its error.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sft.data.encode import IGNORE_INDEX
from sft.models.architectures import known_config
from sft.training import linear_cross_entropy as lce
from sft.training import loss as sft_loss

SHAPES = {"qwen2.5-0.5b": "qwen/qwen2.5-0.5b", "llama-3.2-1b": "meta-llama/llama-3.2-1b",
          "llama-3.1-8b": "meta-llama/llama-3.1-8b"}
VARIANTS = ("chunked", "chunked-128rows", "chunked-4x", "chunked-cast-add", "chunked-unpadded", "chunked-fused",
            "chunked-fused-4x", "chunked-compiled", "liger", "liger-all", "full-logits")
DEFAULT_VARIANTS = tuple(name for name in VARIANTS if name != "chunked-compiled")
WARMUP = 2


class Case:
    """One shape and trained fraction: inputs, trained mask, targets, normaliser, and the fp32 reference."""

    def __init__(self, hidden_size: int, vocab: int, batch: int, length: int, fraction: float, device: str,
                 dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.hidden = (torch.randn(batch * length, hidden_size, generator=g)).to(device, dtype)
        self.weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size ** -0.5).to(device, dtype)
        targets = torch.randint(0, vocab, (batch, length), generator=g)
        targets[:, :length - round(length * fraction)] = IGNORE_INDEX  # the prompt of every row
        self.targets = targets.flatten().to(device)
        self.keep = self.targets != IGNORE_INDEX
        self.trained = int(self.keep.sum())
        self.normalizer = torch.tensor(float(self.trained), device=device)
        self.loss, self.grad_hidden, self.grad_weight = reference(self.hidden, self.weight, self.targets,
                                                                  self.normalizer)

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden.detach().requires_grad_(), self.weight.detach().requires_grad_()


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, normalizer: torch.Tensor,
              rows: int = 2048) -> tuple[float, torch.Tensor, torch.Tensor]:
    """fp32 plain autograd (full logits of `rows` rows at a time): the summed loss / normaliser and its gradients."""
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    total = 0.0
    for start in range(0, h32.shape[0], rows):
        logits = h32[start:start + rows] @ w32.T
        part = F.cross_entropy(logits, targets[start:start + rows], ignore_index=IGNORE_INDEX, reduction="sum")
        (part / normalizer).backward()
        total += float(part.detach())
    return total / float(normalizer), h32.grad, w32.grad


def chunked(case: Case, factor: int = 1, compiled: bool = False, rows: int | None = None,
            fused: bool = False) -> Callable:
    """LinearCrossEntropy at the trained rows (`rows` per chunk, else sft's chunk times `factor`); `compiled`: the
    kernel under torch.compile, the row selection eager (a boolean index is a data-dependent shape, a graph break
    there, and in SFTTrainer's compiled forward too); `fused`: its compiled chunk step (`loss_kernel: fused`)."""
    chunk = rows or lce.chunk_rows(case.weight.shape[0]) * factor

    def kernel(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lce.LinearCrossEntropy.apply(rows, weight, targets, case.normalizer, chunk, 0.0, fused)

    kernel = torch.compile(kernel) if compiled else kernel

    def run(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernel(hidden[case.keep], weight, case.targets[case.keep])

    return run


def with_kernel_part(run: Callable, name: str, part: Callable) -> Callable:
    """`run` with sft.training.linear_cross_entropy's function `name` replaced by `part` while it runs."""
    def run_with(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        original = getattr(lce, name)
        setattr(lce, name, part)
        try:
            return run(hidden, weight)
        finally:
            setattr(lce, name, original)

    return run_with


def chunked_cast_add(case: Case) -> Callable:
    """`chunked` with the weight gradient's product made in the inputs' dtype, then cast and added in float32."""
    def cast_add(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
        grad_weight += (grad_logits.T @ hidden).float()

    return with_kernel_part(chunked(case), "add_weight_grad", cast_add)


def chunked_unpadded(case: Case) -> Callable:
    """`chunked` without the padded copy of a head whose rows are not 16-byte aligned (--vocab 151665)."""
    return with_kernel_part(chunked(case), "aligned_head", lambda head: head)


def liger(case: Case, every_row: bool) -> Callable:
    function = sft_loss.liger_linear_cross_entropy(case.hidden.device)  # SFTError (recorded) off CUDA

    def run(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if every_row:
            return function(hidden, weight, case.targets, ignore_index=IGNORE_INDEX, reduction="sum") / case.normalizer
        keep = case.keep
        return sft_loss.liger_loss(function, hidden[keep], weight, case.targets[keep], case.normalizer, 0.0)

    return run


def full_logits(case: Case) -> Callable:
    def run(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = (hidden @ weight.T).float()
        return F.cross_entropy(logits, case.targets, ignore_index=IGNORE_INDEX, reduction="sum") / case.normalizer

    return run


def build(name: str, case: Case) -> Callable:
    if name == "chunked":
        return chunked(case)
    if name == "chunked-4x":
        return chunked(case, 4)
    if name == "chunked-128rows":
        return chunked(case, rows=128)
    if name == "chunked-cast-add":
        return chunked_cast_add(case)
    if name == "chunked-unpadded":
        return chunked_unpadded(case)
    if name.startswith("chunked-fused"):
        return chunked(case, 4 if name.endswith("-4x") else 1, fused=True)
    if name == "chunked-compiled":
        return chunked(case, compiled=True)
    if name in ("liger", "liger-all"):
        return liger(case, every_row=name == "liger-all")
    return full_logits(case)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(function: Callable, case: Case) -> tuple[float, torch.Tensor, torch.Tensor, float]:
    """One forward + backward on fresh leaves; returns the loss, both gradients and the seconds it took."""
    hidden, weight = case.leaves()
    device = hidden.device.type
    sync(device)
    start = time.perf_counter()
    loss = function(hidden, weight)
    loss.backward()
    sync(device)
    return float(loss.detach()), hidden.grad, weight.grad, time.perf_counter() - start


def measure(name: str, case: Case, repeats: int) -> dict:
    """Median ms, peak memory above the inputs, first-call seconds and exactness of one variant."""
    cuda = case.hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    graphs = dict(counters["stats"]), sum(counters["graph_break"].values())
    function = build(name, case)
    loss, grad_hidden, grad_weight, first = step(function, case)
    compiled = {"graphs": counters["stats"].get("unique_graphs", 0) - graphs[0].get("unique_graphs", 0),
                "graph_breaks": sum(counters["graph_break"].values()) - graphs[1]}
    exact = {"loss_abs_diff": abs(loss - case.loss),
             "grad_hidden_rel_diff": relative(grad_hidden, case.grad_hidden),
             "grad_weight_rel_diff": relative(grad_weight, case.grad_weight)}
    del grad_hidden, grad_weight
    for _ in range(WARMUP - 1):
        step(function, case)
    seconds = [step(function, case)[3] for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    return {"variant": name, "ms": 1e3 * statistics.median(seconds), "first_call_s": first, "peak_bytes": peak,
            "loss": loss, **exact, **compiled}


def relative(grad: torch.Tensor | None, expected: torch.Tensor) -> float | None:
    """max |grad - expected| / max |expected| (None where no gradient came back)."""
    if grad is None:
        return None
    return float((grad.float() - expected).abs().max() / expected.abs().max())


def run_case(shape: str, fraction: float, args: argparse.Namespace, cases: list, save: Callable) -> None:
    """Measure every variant on one shape and fraction into a new entry of `cases`, calling save() after each."""
    config = known_config(SHAPES[shape])
    hidden, vocab, batch, length = config.hidden_size, args.vocab or config.vocab_size, args.batch, args.length
    if args.small:
        hidden, vocab = hidden // 8, vocab // 16
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    case = Case(hidden, vocab, batch, length, fraction, args.device, dtype)
    result = {"shape": shape, "hidden_size": hidden, "vocab_size": vocab, "tokens": batch * length,
              "trained": case.trained, "fraction": fraction, "dtype": str(dtype).removeprefix("torch."),
              "reference_loss": case.loss, "variants": []}
    cases.append(result)
    for name in args.variants.split(","):
        try:
            result["variants"].append(measure(name, case, args.repeats))
        except Exception as error:  # noqa: BLE001  (one failing kernel must not end the run)
            result["variants"].append({"variant": name, "error": f"{type(error).__name__}: {error}"[:500]})
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(line(result, result["variants"][-1]), file=sys.stderr, flush=True)
        save()


def line(case: dict, run: dict) -> str:
    head = f"{case['shape']:<14}{case['fraction']:>5.2f} {run['variant']:<18}"
    if "error" in run:
        return head + "failed: " + run["error"].splitlines()[0][:80]
    peak = f"{run['peak_bytes'] / 2**30:>9.2f}" if run["peak_bytes"] is not None else f"{'-':>9}"
    grads = "".join(f"{value:>11.2e}" if value is not None else f"{'-':>11}"
                    for value in (run["grad_hidden_rel_diff"], run["grad_weight_rel_diff"]))
    return head + f"{run['ms']:>10.2f}{peak}{run['loss_abs_diff']:>11.2e}{grads}{run['first_call_s']:>9.2f}"


def table(results: dict) -> str:
    dtype = results["cases"][0]["dtype"] if results["cases"] else ""
    title = (f"device: {results['device_name']}, {dtype}; median of {results['setup']['repeats']} forward+backward "
             f"after {WARMUP} warm-ups; peak GiB above the inputs (CUDA only); diffs against fp32 plain autograd "
             "(grads: max abs diff / max abs reference)")
    header = (f"{'shape':<14}{'frac':>5} {'variant':<18}{'ms':>10}{'peak GiB':>9}{'loss diff':>11}{'d hidden':>11}"
              f"{'d weight':>11}{'1st s':>9}")
    lines = [title, header, "-" * 98]
    for case in results["cases"]:
        lines += [line(case, run) for run in case["variants"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="shrunk shapes (hidden / 8, vocab / 16, 4 x 256 tokens)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--fractions", default="0.5,1.0", help="trained fractions of the tokens")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all but chunked-compiled)")
    parser.add_argument("--vocab", type=int, help="every shape's vocabulary (default: its config's; e.g. 151665, "
                        "Qwen2.5's tokenizer: a head not 16-byte aligned, for chunked against chunked-unpadded)")
    parser.add_argument("--batch", type=int, help="rows (default 8; --small 4)")
    parser.add_argument("--length", type=int, help="tokens per row (default 2048; --small 256)")
    parser.add_argument("--repeats", type=int, help="timed repeats per variant (default 10; CPU 3)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    args.batch = args.batch or (4 if args.small else 8)
    args.length = args.length or (256 if args.small else 2048)
    args.repeats = args.repeats or (10 if args.device == "cuda" else 3)
    unknown = set(args.variants.split(",")) - set(VARIANTS) | set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown variant or shape: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 reference
    results = {"setup": vars(args), "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "liger_kernel": liger_version(), "cases": []}

    def save() -> None:  # after every variant: a device call cut short still returns what was measured
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    for shape in args.shapes.split(","):
        for fraction in map(float, args.fractions.split(",")):
            run_case(shape, fraction, args, results["cases"], save)
    print(table(results))


def liger_version() -> str | None:
    import importlib.metadata as meta

    try:
        return meta.version("liger-kernel")
    except meta.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
