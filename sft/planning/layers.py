"""What a decoder layer is made of, as the memory formulas read it from the meta-device model: the widths its norms
normalize, a fused query/key/value projection, a gated or plain MLP, and what its activation keeps for backward
(the Model facts of sft.planning.memory that LAYER_BYTES, fitted on Llama-like layers, does not say)."""

import functools

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from sft.planning.cuda_autocast import CudaAutocastOnCpu
from sft.planning.memory import NATIVE_ACTIVATION_BYTES, head_dim, kv_width, mlp_width


def norm_width(layer: nn.Module, arch: PretrainedConfig) -> int:
    """Elements per token the norms of a decoder layer normalize: q/k norms act on every query / key head."""
    widths = {"q_norm": arch.num_attention_heads * head_dim(arch), "k_norm": kv_width(arch)}
    return sum(widths.get(name.rsplit(".", 1)[-1], arch.hidden_size) for name, module in layer.named_modules()
               if type(module).__name__.endswith("Norm"))  # RMSNorm, LayerNorm (GPT-NeoX), each family's own


def layer_projections(layer: nn.Module, arch: PretrainedConfig) -> tuple[int, bool]:
    """(Model.fused_qkv_width, Model.gated_mlp) of a decoder layer, from its linear layers' shapes: a projection of
    the hidden size to q + 2 kv is a fused one; an MLP with exactly one projection of the hidden size to the MLP
    width and none to twice it (a fused gate and up) is not gated (mixtures of experts count as gated)."""
    h, i = arch.hidden_size, getattr(arch, "intermediate_size", None)
    width = arch.num_attention_heads * head_dim(arch) + 2 * kv_width(arch)
    shapes = [(m.in_features, m.out_features) for m in layer.modules() if isinstance(m, nn.Linear)]
    ups = [out for into, out in shapes if into == h and i is not None and out in (i, 2 * i)]
    dense = i is not None and mlp_width(arch) == i
    return (width if (h, width) in shapes else 0), not (dense and ups == [i])


@functools.cache
def activation_saved_bytes(name: str | None) -> float:
    """Bytes an element the MLP's activation (transformers' ACT2FN[name]) keeps for backward on bf16 input, counted on
    a small tensor: 2 for a native one (its input: SiLU, GELU), more for one written as several ops (gelu_new, Phi-2's:
    8 bytes, a 2-layer Phi-2 full fine-tune planned 16% low without it); 2 for a name transformers does not know."""
    if name not in ACT2FN:
        return NATIVE_ACTIVATION_BYTES
    saved = {}
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    with (torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCpu(),
          torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(t.untyped_storage().data_ptr(), t),
                                                   lambda t: t)):
        ACT2FN[name](x)
    return sum(t.untyped_storage().nbytes() for t in saved.values()) / x.numel()


def hidden_act(arch: PretrainedConfig) -> str | None:
    """The MLP activation's name in a config (Gemma-2/3 call it hidden_activation)."""
    return getattr(arch, "hidden_act", None) or getattr(arch, "hidden_activation", None)
