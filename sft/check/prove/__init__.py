"""`sft check RECIPE --prove`: the invariants sft's own tests prove, proven on the recipe's data sample, tokenizer,
chat template and settings, with a tiny random model of its architecture, on CPU in about a minute.

Each proof takes the piece it checks as an argument (or uses sft's own), so tests can inject the faults the
proofs exist to catch. Chat templates that pass are recorded (sft.data.proven_templates), so `sft train` can hint at
running the proofs for one it has not seen pass.
"""

import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from sft.check.prove.batches import prove_batching, prove_packing
from sft.check.prove.bench import Bench
from sft.check.prove.generation import prove_generation
from sft.check.prove.masks import chat_row, prove_masks
from sft.check.prove.result import Proof
from sft.check.prove.runs import prove_resume, prove_save_load
from sft.data.proven_templates import remember_template

log = logging.getLogger(__name__)
DEFAULT_ROWS = 32


def prove_recipe(path: str, flags: list[str] | None = None, rows: int = DEFAULT_ROWS,
                 debug: bool = False) -> list[Proof]:
    """Run every proof on the recipe; SFTError for recipe errors. A proof that crashes is a failed proof."""
    # The Trainer prints logs and metrics to stdout, which holds the proofs' lines (or JSON) alone.
    with tempfile.TemporaryDirectory(prefix="sft-prove-") as tmp, contextlib.redirect_stdout(sys.stderr):
        bench = Bench.build(path, flags, Path(tmp), rows)
        bench.splits  # data errors are recipe errors (exit 2), before any proof runs
        steps = [lambda: prove_masks(bench, rows), lambda: prove_packing(bench), lambda: prove_batching(bench),
                 lambda: prove_resume(bench), lambda: prove_save_load(bench), lambda: prove_generation(bench)]
        names = ["masks", "packing", "batching", "resume", "save/load", "generation"]
        proofs = [attempt(name, step, debug) for name, step in zip(names, steps)]
        if all(p.passed is not False for p in proofs) and uses_chat_template(bench):
            remember_template(bench.tokenizer.chat_template)
    return proofs


def attempt(name: str, step: Callable[[], Proof], debug: bool) -> Proof:
    """Run one proof; an error inside it means the property is not proven (recipe errors surfaced earlier)."""
    start = time.perf_counter()
    try:
        return step()
    except Exception as err:  # noqa: BLE001 - a proof that cannot run has not passed; its evidence says why
        if debug:
            raise
        return Proof(name, False, "could not run", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    finally:
        log.info("proof %s: %.1f s", name, time.perf_counter() - start)


def uses_chat_template(bench: Bench) -> bool:
    raw, decided = bench.raw
    return bool(bench.tokenizer.chat_template) and chat_row(raw[0], decided.format)
