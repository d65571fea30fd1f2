"""A DeepSpeed run's saved model holds its float32 master weights where the recipe loaded float32 weights.

With bf16 (or fp16) DeepSpeed trains 16-bit copies of the weights and keeps float32 masters in the optimizer, and
the Trainer saves the 16-bit copies (ZeRO-3's 16-bit gather, ZeRO-2's module). A recipe that loads float32 weights
with `bf16: true` is mixed precision: one process (or FSDP) trains and saves the float32 weights, so the same
recipe under zero2/zero3 saved a bf16 model that rounded away every update below 1/256 of a weight (most steps at
fine-tuning learning rates). Here each trainable 16-bit weight's float32 master replaces it in the saved state dict
(and config.json says float32), so the saved model is the trained one. A recipe that loads 16-bit weights still
saves 16-bit ones, as one process would; LoRA adapters DeepSpeed already keeps (and saves) in float32.
"""

import torch
from torch import nn
from transformers import PreTrainedModel

HALF = (torch.bfloat16, torch.float16)


def loaded_in_float32(model: nn.Module) -> bool:
    """Whether `model` (a plain transformers model, not a PEFT one) was loaded with float32 weights. Read before
    DeepSpeed casts it: from_pretrained records the dtype it loaded in config.dtype, which zero.Init leaves alone."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    return isinstance(model, PreTrainedModel) and dtype in (torch.float32, "float32")


def master_weights(engine: nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """The float32 master of every trainable 16-bit parameter of a DeepSpeed engine's module, by state-dict name
    (tied names share one tensor), on the CPU of the main process; empty on the others. Every rank must call it:
    each master is gathered from the ranks' partitions."""
    from deepspeed.utils import safe_get_full_fp32_param

    names: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    masters = {}
    for name, param in engine.module.named_parameters():  # one gather per tensor, in the same order on every rank
        if not param.requires_grad or param.dtype not in HALF:
            continue
        master = safe_get_full_fp32_param(param)
        if master is None or not is_main:
            continue
        master = master.detach().reshape(getattr(param, "ds_shape", param.shape)).cpu()
        masters.update(dict.fromkeys(names[id(param)], master))
    return masters
