"""Rewrite each recipe header's "Memory:" line from `sft plan` (tests/test_plan.py fails when one drifts >10%).

    python scripts/plan_headers.py [recipes/...yaml ...]     # default: every recipe the planner models

The GPU count comes from the header's "Hardware: Nx..." line (1 when it names none); memory does not depend on the
GPU kind, so H100-80GB is used.
"""

import sys
from pathlib import Path

from sft.errors import SFTError
from sft.planning.hardware import find_gpu
from sft.planning.plan import Plan, plan_recipe
from sft.training.catalog import default_root, list_recipes, read_header
from sft.training.recipe import load_recipe

CPU = " On CPU: "


def memory_line(plan: Plan, old: str) -> list[str]:
    """The header's Memory value, wrapped as header continuation lines; a hand-written CPU note is kept."""
    s, b = plan.setup, plan.breakdown
    cpu = old.split(CPU, 1)[1] if CPU in old else "" if old.startswith("~") else old
    checkpointing = "on" if s.checkpointing else "off"
    text = (f"~{plan.total_gib:.1f} GiB per GPU (sft plan: {plan.peak_gib:.1f} GiB allocated at the peak, training "
            f"{b['training peak']:.1f} / eval {b['eval / generation']:.1f}, + CUDA context and fragmentation) at "
            f"max_length {s.max_length}, micro-batch {s.micro_batch}, checkpointing {checkpointing}, {s.method}, "
            f"{s.preset}{f' x{s.world}' if s.world > 1 else ''}." + (f"{CPU}{cpu}" if cpu else ""))
    words, lines, current = text.split(), [], "# Memory:"
    for word in words:
        if len(current) + 1 + len(word) > 116:
            lines.append(current)
            current = "#  "
        current += " " + word
    return lines + [current]


def rewrite(path: Path) -> bool:
    """Replace the Memory line (and its continuation lines) of one recipe; False if the planner cannot model it."""
    info = read_header(path, path.parent)
    try:
        plan = plan_recipe(load_recipe(path), find_gpu("H100-80GB"), info.num_gpus)
    except SFTError as err:
        print(f"{path}: skipped ({err})")
        return False
    lines, out, skipping = path.read_text(encoding="utf-8").splitlines(), [], False
    for line in lines:
        if line.startswith("# Memory:"):
            out += memory_line(plan, info.fields["Memory"])
            skipping = True
        elif skipping and line.startswith("#   "):
            continue
        else:
            out.append(line)
            skipping = False
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    print(f"{path}: {plan.total_gib:.1f} GiB")
    return True


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or [r.path for r in list_recipes(default_root())]
    for recipe in paths:
        rewrite(recipe)
