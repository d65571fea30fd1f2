"""Save/load under a sharded preset: 2 CPU processes train the tiny model (ZeRO-2/3 or DDP, as `sft launch` would
on GPUs); the final save must hold exactly the trained weights of the run's last checkpoint (for ZeRO, the fp32
weights DeepSpeed consolidates from every rank's shard). FSDP needs CUDA and is reported as not provable."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from sft.check.prove.bench import Bench
from sft.models.adapters import is_adapter_folder
from sft.training.recipe import save_recipe

PROCESSES = 2
STEPS = 2
RUNS_ON_CPU = ("ddp", "zero2", "zero3", "zero3_offload")
# What an adapter trains, by parameter name: LoRA matrices (DoRA magnitudes too), the rows of tokens the run added
# (peft trainable tokens) and whole modules in lora_modules_to_save; everything else is the frozen base.
ADAPTER_PARAMETERS = ("lora_", "trainable_tokens_delta", "modules_to_save.")


def prove_sharded_save(bench: Bench) -> tuple[bool | None, str]:
    """(passed, figure) for the recipe's sharded preset; passed is None when there is none or it needs a GPU."""
    preset = bench.recipe.distributed
    if not preset:
        return None, ""
    if preset not in RUNS_ON_CPU:
        return None, f"sharded preset {preset}: not provable on CPU (FSDP needs CUDA)"
    run = bench.folder / "sharded"
    error = train_on_processes(bench, preset, run)
    if error:
        return False, f"{preset} on {PROCESSES} CPU processes failed: {error}"
    expected, saved = checkpoint_weights(run / f"checkpoint-{STEPS}", preset, bench), reloaded(run, bench)
    missing = sorted(set(expected) - set(saved))
    differ = [k for k in expected if k in saved and not torch.equal(expected[k], saved[k])]
    figure = (f"{preset} on {PROCESSES} CPU processes: {len(expected) - len(missing) - len(differ)}/{len(expected)} "
              "trained tensors saved bitwise")
    return not missing and not differ and bool(expected), figure + (f" (wrong: {(missing + differ)[:3]})"
                                                                    if missing or differ else "")


def train_on_processes(bench: Bench, preset: str, run: Path) -> str | None:
    """`sft train` of the bench recipe under torchrun; returns the last error line, or None when it succeeded."""
    # fp16 off: CPU processes have no fp16 autocast, so a recipe's fp16 is refused with use_cpu (check_cpu_fp16)
    config = bench.config(distributed=preset, use_cpu=True, fp16=False, output_dir=str(run), max_steps=STEPS,
                          save_strategy="steps", save_steps=STEPS, per_device_train_batch_size=2,
                          gradient_accumulation_steps=1, overwrite_output_dir=True)
    unset_hf_deepspeed_config()  # building a ZeRO-3 config set it for this process, whose models stay whole
    bench.folder.mkdir(parents=True, exist_ok=True)
    recipe = bench.folder / "sharded.yaml"
    save_recipe(config, recipe)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PROCESSES),
               "-m", "sft", "train", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if "rror" in line] or done.stderr.splitlines() or ["?"]
    return lines[-1][:300]


def checkpoint_weights(checkpoint: Path, preset: str, bench: Bench) -> dict[str, torch.Tensor]:
    """The trained weights a checkpoint holds: ZeRO's consolidated fp32 shards, or the DDP checkpoint's model."""
    if preset.startswith("zero"):
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        adapter = is_adapter_folder(checkpoint)
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), exclude_frozen_parameters=adapter)
    return reloaded(checkpoint, bench)


def reloaded(folder: Path, bench: Bench) -> dict[str, torch.Tensor]:
    """A saved model's state, or the weights an adapter trains (ADAPTER_PARAMETERS), as sft loads them back. Not the
    LoRA matrices alone: a ZeRO checkpoint holds every trained tensor, and new tokens' rows or modules_to_save
    missing here read as not saved (a LoRA recipe whose chat template adds tokens FAILed on zero3: 28/30)."""
    model = bench.model(bench.config(model_name_or_path=str(folder)))
    if is_adapter_folder(folder):
        return {k: p.detach() for k, p in model.named_parameters() if any(part in k for part in ADAPTER_PARAMETERS)}
    return {k: v.detach() for k, v in model.state_dict().items()}
