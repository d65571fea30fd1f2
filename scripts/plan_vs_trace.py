"""Print the planner's per-GPU training peak against the MemTracker/FakeTensor step for tests/test_plan.py's sweep.

    python scripts/plan_vs_trace.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_plan import SWEEP, planned_and_traced, recipe  # noqa: E402

from sft.architectures import known_config  # noqa: E402

print(f"{'model':<26}{'method':<7}{'micro x len':>12}{'ckpt':>5}{'GA':>4}{'plan GiB':>10}{'trace GiB':>10}{'error':>8}"
      f"{'secs':>6}")
for model, method, micro, length, checkpointing, accumulation in SWEEP:
    start = time.perf_counter()
    values = recipe(model, method, micro, length, checkpointing, gradient_accumulation_steps=accumulation)
    planned, traced = planned_and_traced(values, known_config(model))
    print(f"{model.split('/')[1]:<26}{method:<7}{f'{micro} x {length}':>12}{'on' if checkpointing else 'off':>5}"
          f"{accumulation:>4}{planned / 2 ** 30:>10.2f}{traced / 2 ** 30:>10.2f}{100 * (planned / traced - 1):>+7.1f}%"
          f"{time.perf_counter() - start:>6.0f}", flush=True)
