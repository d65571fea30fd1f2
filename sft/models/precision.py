"""The dtype each part of an adapted model computes and trains in, under mixed precision and without it."""

import types

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from sft.config.arguments import SFTConfig


def upcasts_quantized_base(config: SFTConfig) -> bool:
    """Whether a quantized base's non-quantized weights train in float32 (peft's k-bit preparation): all but bf16,
    and DoRA under bf16 too: it computes its weight norm in its input's dtype, the residual stream's."""
    return not config.bf16 or bool(config.use_dora)


def upcast_trained_copies(model: nn.Module) -> None:
    """Make trained 16-bit weights float32: peft upcasts its adapters itself, not a lora_modules_to_save copy of a
    bf16 layer, which AdamW would update with steps below bf16's precision rounded away."""
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()


def adapter_inputs_as_they_come(model: nn.Module) -> None:
    """Under autocast, LoRA layers hand their input to dropout and the adapter as it comes, not cast to float32.

    peft casts a LoRA layer's input to its float32 adapter's dtype, runs dropout in float32, and autocast casts the
    result back to bf16 for the adapter's matmul: on Llama-3.1-8B LoRA (H100, 2 x 2048 tokens, BENCHMARKS.md) those
    casts and the float32 dropout took 137 of the 610 ms of kernel time a step. Autocast runs the matmul in bf16
    either way, so the result is the same (bitwise without dropout, tests/test_lora.py), as peft's own 4-bit layers
    already do under autocast. Without autocast peft's cast stays: a float32 adapter needs float32 input. So does a
    DoRA layer's: DoRA computes its weight norm in the input's dtype.
    """
    for module in model.modules():
        if isinstance(module, LoraLayer) and not getattr(module, "lora_variant", None):
            module._cast_input_dtype = types.MethodType(_cast_outside_autocast, module)


def _cast_outside_autocast(layer: LoraLayer, x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
        return x
    return type(layer)._cast_input_dtype(layer, x, dtype)
