"""Print the planner's per-GPU training peak against the MemTracker/FakeTensor step for tests/test_plan.py's sweep,
and its eval transient (beyond the weights; eval batch = micro-batch) against the simulated eval step.

    python scripts/plan_vs_trace.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_plan import SWEEP, planned_and_traced, recipe  # noqa: E402

from sft.models.architectures import known_config  # noqa: E402
from sft.planning import memory  # noqa: E402
from sft.planning import plan as planner
from sft.planning.memtrace import trace_step  # noqa: E402
from sft.training.recipe import load_recipe  # noqa: E402


def eval_planned_and_traced(values: dict, arch) -> tuple[float, float]:
    """(planner's eval term, the simulated eval step's peak beyond parameters), bytes."""
    config = load_recipe({**values, "eval_strategy": "steps", "eval_split_size": 0.1,
                          "per_device_eval_batch_size": values["per_device_train_batch_size"]})
    setup = planner.setup_of(config, 1, 1)
    trace = trace_step(config, arch, evaluate=True)
    planned = memory.eval_bytes(config, arch, setup, planner.model_facts(config, arch, setup.method))
    return planned, trace.peak - trace.by_kind["Parameter"] - trace.by_kind.get("Buffer", 0)



print(f"{'model':<26}{'method':<7}{'micro x len':>12}{'ckpt':>5}{'GA':>4}{'plan GiB':>10}{'trace GiB':>10}{'error':>8}"
      f"{'eval plan':>10}{'eval trace':>11}{'error':>8}{'secs':>6}")
for model, method, micro, length, checkpointing, accumulation in SWEEP:
    start = time.perf_counter()
    values = recipe(model, method, micro, length, checkpointing, gradient_accumulation_steps=accumulation)
    planned, traced = planned_and_traced(values, known_config(model))
    eval_planned, eval_traced = eval_planned_and_traced(values, known_config(model))
    print(f"{model.split('/')[1]:<26}{method:<7}{f'{micro} x {length}':>12}{'on' if checkpointing else 'off':>5}"
          f"{accumulation:>4}{planned / 2 ** 30:>10.2f}{traced / 2 ** 30:>10.2f}{100 * (planned / traced - 1):>+7.1f}%"
          f"{eval_planned / 2 ** 30:>10.2f}{eval_traced / 2 ** 30:>11.2f}{100 * (eval_planned / eval_traced - 1):>+7.1f}%"
          f"{time.perf_counter() - start:>6.0f}", flush=True)
