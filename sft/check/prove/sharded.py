"""Save/load under a sharded preset: 2 CPU processes train the tiny model (DDP, ZeRO-2/3 or FSDP2, as `sft launch`
would on GPUs); the final save must hold exactly the trained weights of the run's last checkpoint (for ZeRO, the fp32
weights DeepSpeed consolidates from every rank's shard; for FSDP, the sharded checkpoint's pieces put together).
FSDP runs through sft.check.prove.fsdp_on_cpu, as accelerate would otherwise run DDP on CPU."""

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
# The preset each one runs as here: fsdp_offload's CPU offload pins host memory, which needs an accelerator (torch:
# "Cannot access accelerator device"); its sharding, checkpoints and saves are fsdp's.
RUNS_ON_CPU_AS = {"fsdp_offload": "fsdp"}
# What an adapter trains, by parameter name: LoRA matrices (DoRA magnitudes too), the rows of tokens the run added
# (peft trainable tokens) and whole modules in lora_modules_to_save; everything else is the frozen base.
ADAPTER_PARAMETERS = ("lora_", "trainable_tokens_delta", "modules_to_save.")


def prove_sharded_save(bench: Bench) -> tuple[bool | None, str]:
    """(passed, figure) for the recipe's sharded preset; passed is None when there is none."""
    preset = bench.recipe.distributed
    if not preset:
        return None, ""
    ran = RUNS_ON_CPU_AS.get(preset, preset)
    label = preset if ran == preset else f"{preset} (as {ran}: CPU offload needs CUDA)"
    run = bench.folder / "sharded"
    error = train_on_processes(bench, ran, run)
    if error:
        return False, f"{label} on {PROCESSES} CPU processes failed: {error}"
    passed, counts = compare_saved(run, ran, bench)
    return passed, f"{label} on {PROCESSES} CPU processes: {counts}"


def compare_saved(run: Path, preset: str, bench: Bench) -> tuple[bool, str]:
    """Whether the run's final save holds exactly its last checkpoint's trained weights, and the counts."""
    expected = checkpoint_weights(run / f"checkpoint-{STEPS}", preset, bench)
    saved = reloaded(run, bench, peft_names=preset == "fsdp")
    missing = sorted(set(expected) - set(saved))
    differ = [k for k in expected if k in saved and not torch.equal(expected[k], saved[k])]
    counts = f"{len(expected) - len(missing) - len(differ)}/{len(expected)} trained tensors saved bitwise"
    wrong = f" (wrong: {(missing + differ)[:3]})" if missing or differ else ""
    return not missing and not differ and bool(expected), counts + wrong


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
    entry = "sft.check.prove.fsdp_on_cpu" if preset == "fsdp" else "sft"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PROCESSES),
               "-m", entry, "train", str(recipe)]
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
    if preset == "fsdp":
        return fsdp_checkpoint_weights(checkpoint, bench)
    return reloaded(checkpoint, bench)


def fsdp_checkpoint_weights(checkpoint: Path, bench: Bench) -> dict[str, torch.Tensor]:
    """The model of an FSDP checkpoint, put together from every rank's shard (torch's distributed-checkpoint
    files); for an adapter run, the tensors it trains."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = bench.folder / "fsdp-consolidated.pt"
    dcp_to_torch_save(checkpoint / "pytorch_model_fsdp_0", whole)
    return torch.load(whole, weights_only=True)["model"]  # an adapter run's holds the adapter alone, named as peft saves it


def reloaded(folder: Path, bench: Bench, peft_names: bool = False) -> dict[str, torch.Tensor]:
    """A saved model's state, or the weights an adapter trains (ADAPTER_PARAMETERS), as sft loads them back. Not the
    LoRA matrices alone: a ZeRO checkpoint holds every trained tensor, and new tokens' rows or modules_to_save
    missing here read as not saved (a LoRA recipe whose chat template adds tokens FAILed on zero3: 28/30).
    peft_names: an adapter's tensors as peft saves them (no adapter name), as FSDP checkpoints hold them."""
    model = bench.model(bench.config(model_name_or_path=str(folder)))
    if is_adapter_folder(folder) and peft_names:
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    if is_adapter_folder(folder):
        return {k: p.detach() for k, p in model.named_parameters() if any(part in k for part in ADAPTER_PARAMETERS)}
    return {k: v.detach() for k, v in model.state_dict().items()}
