"""`sft launch`: run `sft train` on every GPU (and machine) through `accelerate launch` with a preset config.

Which flag goes where: --preset, --num_processes and --dry_run belong to sft launch. A flag that `accelerate launch`
accepts goes to accelerate (--num_machines, --machine_rank, --main_process_ip, --main_process_port, ...), unless
it is also a recipe key (--gradient_accumulation_steps): recipe keys override the recipe. Every other
flag, and everything after `--`, overrides a recipe key.
"""

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from sft.errors import SFTError
from sft.training.presets import ACCELERATE_CONFIGS, DEEPSPEED_CONFIGS, PRESETS
from sft.training.recipe import FIELDS, SECRET_KEYS, coerce, parse_flags, read_recipe_file


def launch(recipe: str, argv: list[str], preset: str | None = None, num_processes: int | None = None,
           dry_run: bool = False) -> int:
    """Print (dry_run) or run the accelerate command for `recipe`; returns its exit code. A token given on the
    command line reaches the processes as HF_TOKEN, never in the printed command or their argv (job logs, ps)."""
    argv, token = without_secrets(argv)
    command = launch_command(recipe, argv, preset, num_processes)
    print(shlex.join(command), flush=True)
    if dry_run:
        return 0
    if token:
        os.environ["HF_TOKEN"] = token  # the processes inherit it
    return run_accelerate(command)


def run_accelerate(command: list[str]) -> int:
    """Run the `accelerate launch` command in this process; the exit code of the first process that failed, or 0.

    Run as its own program, accelerate ends a failed run with torch elastic's ChildFailedError (or a
    CalledProcessError) traceback and exit code 1, after every process has printed sft's one-line error and exited 2:
    a recipe typo under `sft launch` read as a crash. Here the processes' own messages and exit code stand."""
    from accelerate.commands.launch import launch_command as accelerate_launch_command
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        accelerate_launch_command(launch_command_parser().parse_args(command[2:]))
    except ChildFailedError as failed:
        return failed.get_first_failure()[1].exitcode or 1
    except subprocess.CalledProcessError as failed:
        return failed.returncode
    return 0


def without_secrets(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--hub_token T` / `--token=T` (SECRET_KEYS), and the last token given."""
    kept, token, i = [], None, 0
    while i < len(argv):
        key, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if key.replace("-", "_") not in SECRET_KEYS:
            kept.append(argv[i])
        elif eq:
            token = value
        elif i + 1 < len(argv):
            token, i = argv[i + 1], i + 1
        i += 1
    return kept, token


def launch_command(recipe: str, argv: list[str], preset: str | None = None,
                   num_processes: int | None = None) -> list[str]:
    """`accelerate launch --config_file PRESET.yaml ... -m sft train RECIPE [overrides]`.

    Args:
        recipe: the recipe path, passed on unchanged (the processes start in this directory).
        argv: the flags after RECIPE: accelerate flags and recipe overrides, split by the module's rule.
        preset: a key of PRESETS; default: the recipe's (or override's) `distributed`, else ddp.
        num_processes: processes over all machines; default: visible GPUs x --num_machines.
    """
    values = read_recipe_file(recipe)
    accelerate_args, overrides = split_arguments(argv)
    flags = parse_flags(overrides)
    for key, value in flags.items():  # fail here, not once per process
        coerce(key, value, "command line", from_text=True)
    if preset:
        overrides += ["--distributed", preset]  # the Trainer's settings must match the launcher's
    preset = preset or flags.get("distributed") or values.get("distributed") or "ddp"
    if preset not in PRESETS:
        raise SFTError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}.")
    given = parse_flags(accelerate_args)
    command = [*accelerate_launch(), "--config_file", str(ACCELERATE_CONFIGS[preset]),
               "--num_processes", str(num_processes or default_num_processes(given))]
    if preset in DEEPSPEED_CONFIGS and "deepspeed_config_file" not in given:
        deepspeed = flags.get("deepspeed") or values.get("deepspeed")
        path = deepspeed if isinstance(deepspeed, str) else DEEPSPEED_CONFIGS[preset]
        command += ["--deepspeed_config_file", str(Path(path).resolve())]  # the YAML's path is repo-relative
    return [*command, *accelerate_args, "-m", "sft", "train", recipe, *overrides]


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch flags, recipe overrides), by the rule in this module's docstring."""
    options = accelerate_options()
    accelerate, recipe = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            recipe += argv[i + 1:]
            break
        key, eq, _ = arg[2:].partition("=")
        key = key.replace("-", "_")
        to_accelerate = arg.startswith("--") and key in options and key not in FIELDS
        takes_value = options[key] if to_accelerate else i + 1 < len(argv) and not argv[i + 1].startswith("--")
        count = 2 if takes_value and not eq and i + 1 < len(argv) else 1
        (accelerate if to_accelerate else recipe).extend(argv[i:i + count])
        i += count
    return accelerate, recipe


def accelerate_options() -> dict[str, bool]:
    """Every `accelerate launch` option (underscored, without --) mapped to whether it takes a value."""
    from accelerate.commands.launch import launch_command_parser

    parser: argparse.ArgumentParser = launch_command_parser()
    return {flag[2:].replace("-", "_"): action.nargs != 0
            for action in parser._actions for flag in action.option_strings if flag.startswith("--")}


def default_num_processes(accelerate_args: dict[str, str]) -> int:
    """One process per visible GPU on each machine."""
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SFTError("No GPU is visible here, so sft launch cannot count processes: pass --num_processes N "
                       "(the total over all machines).")
    return gpus * int(accelerate_args.get("num_machines", 1))


def accelerate_launch() -> list[str]:
    """`accelerate launch` of this Python environment, so the processes run the same sft."""
    script = Path(sys.executable).with_name("accelerate")
    return [str(script), "launch"] if script.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
