"""CUDA's autocast, acted out on the CPU: the simulated step (sft.planning.memtrace) and the activation probe
(sft.planning.layers) run on the CPU, whose bf16 autocast runs most elementwise and normalization ops in their input's
dtype, while CUDA's runs a list of them in float32. A LayerNorm of bf16 activations therefore keeps a bf16 input on
the CPU and a float32 copy on a GPU, and gelu_new (Phi-2, GPT-2) keeps float32 intermediates on a GPU only. Under
CudaAutocastOnCpu those ops get float32 inputs, as CUDA's autocast gives them, so the step keeps what a GPU keeps.
"""

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from sft.models.attention import HALF

# torch.amp's "CUDA Ops that can autocast to float32" (the Autocast Op Reference); in-place variants and calls with an
# explicit dtype are not autocast, there or here.
FLOAT32_OPS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss"})


class CudaAutocastOnCpu(TorchFunctionMode):
    """While the CPU's autocast is on, CUDA's float32 ops get float32 copies of their 16-bit inputs."""

    def __torch_function__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) in FLOAT32_OPS and kwargs.get("dtype") is None
                and torch.is_autocast_enabled("cpu")):
            args, kwargs = tree_map(upcast, (args, kwargs))
        return func(*args, **kwargs)


def upcast(value: Any) -> Any:
    """A 16-bit floating tensor as float32; anything else as it is."""
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in HALF else value
