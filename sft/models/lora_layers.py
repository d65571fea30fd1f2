"""How sft's LoRA layers add the adapter to the base layer: peft's layers, with the adapter's output scaled and added
inside the adapter's second matmul.

peft computes `result + lora_B(lora_A(dropout(x))) * scaling`: beside the matmuls, a scaling pass and an add over
the layer's whole output, and the scaling once more over its gradient; its 4-bit layers clone the base's output
first. On Llama-3.1-8B LoRA (H100, 2 x 2048 tokens, checkpointing: every forward twice) the scaling's kernels took
21.7 ms and bf16 adds 40.8 ms of a 589 ms step (BENCHMARKS.md). One `addmm(result, down, lora_B.T, alpha=scaling)`
computes the same sum in the matmul's float32 epilogue, rounded once instead of three times, and its backward scales
only the rank-r tensors.
"""

import types
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from torch.distributed.tensor import DTensor

try:  # peft defines its bitsandbytes layers only where bitsandbytes imports
    from peft.tuners.lora.bnb import Linear4bit, Linear8bitLt

    FUSED_TYPES: tuple[type, ...] = (LoraLinear, Linear4bit, Linear8bitLt)
except ImportError:
    FUSED_TYPES = (LoraLinear,)


def fuse_adapter_add(model: nn.Module) -> int:
    """Make the plain LoRA layers of `model` (peft's over nn.Linear and bitsandbytes' 4- and 8-bit linears, exactly
    those types) add their adapter inside its matmul; returns how many. A layer falls back to peft's own forward
    whenever peft's does more than the plain sum: adapters disabled or merged, several or mixed-batch adapters, a
    variant (DoRA), a bias on lora_B, a lora_B weight that only its own call gathers (ZeRO-3, an FSDP2 unit)."""
    layers = [m for m in model.modules() if type(m) in FUSED_TYPES]
    for layer in layers:
        layer.forward = types.MethodType(fused_forward, layer)
    return len(layers)


def not_gathered(weight: torch.Tensor) -> bool:
    """Whether a sharded wrapper gathers `weight` only in its module's own call: a ZeRO-3 partition, or a DTensor
    (lora_B as an FSDP2 unit of its own)."""
    return hasattr(weight, "ds_id") or isinstance(weight, DTensor)


def fused_forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer's output: base(x) + scaling * lora_B(lora_A(dropout(x))), the sum made by lora_B's addmm."""
    name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    lora_B = self.lora_B[name] if name in self.lora_B else None
    if (kwargs or self.disable_adapters or self.merged or lora_B is None or name in self.lora_variant
            or lora_B.bias is not None or not_gathered(lora_B.weight)):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args)
    lora_A = self.lora_A[name]
    down = lora_A(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.weight.dtype)))
    if not torch.is_autocast_enabled(result.device.type) and not result.dtype == down.dtype == lora_B.weight.dtype:
        return result + (lora_B(down) * self.scaling[name]).to(result.dtype)  # no common dtype: peft's sum
    total = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), lora_B.weight.T,
                        alpha=self.scaling[name])
    return total.view(result.shape).to(result.dtype)
