"""Stanford Alpaca's train.py command line, run on sft's own config, data and trainer layers.

The Alpaca README command no longer runs on current transformers (`--evaluation_strategy` was renamed,
`--fsdp_transformer_layer_cls_to_wrap` moved into `fsdp_config`); here those flags are mapped with a notice, and
on a machine without a GPU the GPU-only flags are dropped with a notice so the same command can be smoke-tested.
"""

import logging
import sys

import torch

from sft.cli.console import (
    closed_stdout,
    end_distributed,
    quiet_optional_backends,
    recipe_keys_help,
    setup_logging,
)
from sft.errors import SFTError
from sft.training.flows import train
from sft.training.recipe import RENAMED, coerce, load_recipe, parse_flags

log = logging.getLogger(__name__)
GPU_ONLY = ("bf16", "tf32", "fsdp", "fsdp_config", "fsdp_transformer_layer_cls_to_wrap")
USAGE = ("usage: train_alpaca.py --model_name_or_path M --data_path alpaca_data.json --output_dir O [flags]\n"
         "Stanford Alpaca train.py flags; renamed ones (--evaluation_strategy, --model_max_length, "
         "--fsdp_transformer_layer_cls_to_wrap) are mapped with a notice; any recipe key below is accepted.")
# What Stanford's train.py fixes in code rather than in flags.
ALPACA_DEFAULTS = {"dataset_format": "alpaca", "completion_only_loss": True, "pad_token": "[PAD]",
                   "max_length": 512, "optim": "adamw_torch"}


def alpaca_recipe(argv: list[str], has_gpu: bool) -> tuple[dict, list[str]]:
    """Recipe values (Alpaca's fixed settings and mapped structured flags) and --key value flags for the rest."""
    values, flags = dict(ALPACA_DEFAULTS), []
    parsed = parse_flags(argv)
    # bf16 with use_cpu asked for is CPU bf16 autocast, as in `sft train`: dropping it trained fp32.
    cpu_bf16 = "use_cpu" in parsed and coerce("use_cpu", parsed["use_cpu"], "command line", from_text=True)
    for key, value in parsed.items():
        if (not has_gpu and key in GPU_ONLY and value.lower() not in ("false", "no", "", "none")
                and not (key == "bf16" and cpu_bf16)):
            log.warning("Notice: no GPU here, dropping --%s %s (GPU only).", key, value)
        elif key == "fsdp_transformer_layer_cls_to_wrap":
            log.warning("Notice: --%s is now fsdp_config.transformer_layer_cls_to_wrap.", key)
            values["fsdp_config"] = {"transformer_layer_cls_to_wrap": [value]}
        else:
            if key in RENAMED:
                log.warning("Notice: --%s is now --%s.", key, RENAMED[key])
            flags += [f"--{RENAMED.get(key, key)}", value]
    return values, flags


def main(argv: list[str] | None = None) -> int:
    """Entry point of scripts/train_alpaca.py and `sft alpaca`."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        try:
            print(USAGE + "\n" + recipe_keys_help())
        except BrokenPipeError:  # `train_alpaca.py --help | head`
            return closed_stdout()
        return 0
    debug = "--debug" in argv
    setup_logging()
    quiet_optional_backends()
    try:
        values, flags = alpaca_recipe([a for a in argv if a != "--debug"], torch.cuda.is_available())
        train(load_recipe(values, flags=flags))
        end_distributed()
    except SFTError as err:
        end_distributed(err)  # after a stop all ranks agreed on (a signal, divergence), as on success
        if debug:
            raise
        print(f"train_alpaca: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0
