"""`attn_implementation: varlen`: packed and padding-free batches through torch's own variable-length flash kernel.

`torch.nn.attention.varlen.varlen_attn` (CUDA, no flash-attn package) attends within each example of a flattened
batch given its cumulative lengths (cu_seq_lens), so no [L, L] mask is built. `register()` adds the function to
transformers' AttentionInterface under `VARLEN`, and flash attention's mask builder to its AttentionMaskInterface:
a batch without padding then reaches the function with no mask at all, and a padded batch (generation, unpacked
eval) with its 2D padding mask, which the function honours through sdpa rather than dropping it.

Example boundaries come from the collator's `cu_seq_lens_q` / `max_length_q` (PaddingFreeCollator computes them on
the host: no GPU sync), else from position_ids by sft.data.boundaries' rule (restarts), else one per row.
torch versions differ: older kernels take `is_causal` (no GQA, no window), newer ones `window_size` and `enable_gqa`;
the signature decides, and what the kernel cannot do is done around it (GQA heads repeated) or refused (a window).
"""

import difflib
import functools
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from sft.errors import SFTError
from sft.models.families import VARLEN

HALF = (torch.bfloat16, torch.float16)
# The config keys transformers' families name their attention dropout by (Llama's, GPT-2's and GPT-J's, ...).
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attn_dropout")


def _torch_kernel() -> Callable | None:
    """torch's varlen_attn, or None where this torch has none (older releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn as kernel
    except ImportError:
        return None
    return kernel


TORCH_VARLEN = _torch_kernel()
varlen_attn = TORCH_VARLEN  # the kernel called; tests replace it with a CPU reference


@torch.compiler.assume_constant_result  # under torch_compile read once while tracing (dynamo traces into lru_cache)
def kernel_style(kernel: Callable) -> tuple[bool, bool, bool]:
    """(takes window_size, takes enable_gqa, takes scale) of a varlen_attn: newer torch says causal with
    window_size=(-1, 0), older with is_causal=True."""
    return _kernel_style(kernel)


@functools.lru_cache(maxsize=8)
def _kernel_style(kernel: Callable) -> tuple[bool, bool, bool]:
    params = inspect.signature(kernel).parameters
    if "window_size" not in params and "is_causal" not in params:
        raise SFTError("This torch's varlen_attn takes neither window_size nor is_causal; sft cannot make it causal. "
                       "Use attn_implementation sdpa.")
    return "window_size" in params, "enable_gqa" in params, "scale" in params


FLASH_AVAILABLE = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}


def attention_problem(name: str, cuda: bool, cpu_training: bool) -> str | None:
    """Why attn_implementation `name` cannot run here (cuda: the run is on a CUDA GPU; cpu_training: it trains on
    the CPU), or None; asked before any data or weights load, as each would otherwise fail at its first step (varlen,
    flex) or, with a traceback, while loading the model (flash attention without its package)."""
    known = (*ALL_ATTENTION_FUNCTIONS, "eager", VARLEN)
    if name not in known and not {"|", "/"} & set(name):  # paged|... and Hub kernels (org/repo) are transformers'
        close = difflib.get_close_matches(name, known, n=1)
        return (f"attn_implementation: {name!r} is not an attention backend"
                + (f". Did you mean {close[0]}?" if close else "")
                + f" Use one of eager, sdpa, flex_attention, flash_attention_2, flash_attention_3 or {VARLEN}.")
    if name == VARLEN and not cuda and varlen_attn is TORCH_VARLEN:  # (tests run a CPU stand-in)
        return (f"attn_implementation: {VARLEN} runs torch's flash kernel, which needs a CUDA GPU, and this run has "
                "none (use_cpu, or no GPU). Set attn_implementation: sdpa (packing and padding_free work with it).")
    if name in FLASH_AVAILABLE and not (cuda and FLASH_AVAILABLE[name](kernels_fallback_ok=True)):
        reason = "this run has no CUDA GPU (use_cpu, or no GPU)" if not cuda else "its package is not installed"
        return (f"attn_implementation: {name} needs a CUDA GPU and the flash-attn package, and {reason}. Set "
                "attn_implementation: sdpa, or install flash-attn on a GPU machine.")
    if name == "flex_attention" and cpu_training and not flex_backward_on_cpu():
        return (f"attn_implementation: flex_attention cannot train on the CPU: this torch ({torch.__version__}) has "
                "no flex attention backward there. Set attn_implementation: sdpa to train on CPU (sft eval may "
                "keep flex_attention).")
    return None


@functools.cache
def flex_backward_on_cpu() -> bool:
    """Whether this torch's flex_attention takes CPU inputs that need gradients (asked, not guessed from versions:
    torch refuses them before computing anything, so the probe costs microseconds)."""
    from torch.nn.attention.flex_attention import flex_attention
    states = torch.zeros(1, 1, 1, 16, requires_grad=True)
    try:
        flex_attention(states, states, states)
    except NotImplementedError:
        return False
    return True


def varlen_problem(model_config: PretrainedConfig, max_length: int | None) -> str | None:
    """What of this model's attention `varlen` cannot compute (a clause: "it ..."), or None; read from its config and
    its transformers class before any weights load, for examples up to `max_length` tokens (None: any length)."""
    text = model_config.get_text_config()
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    if model_class is None or not hasattr(sys.modules[model_class.__module__], "ALL_ATTENTION_FUNCTIONS"):
        return ("builds its own attention classes instead of calling transformers' AttentionInterface (Falcon, "
                "remote code)")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "soft-caps its attention logits (Gemma-2)"
    dropout = max(float(getattr(text, key, None) or 0.0) for key in DROPOUT_KEYS)
    if dropout:
        return f"drops attention weights out in training ({dropout}), which the flash kernel cannot"
    longest = max_length or math.inf
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and longest > chunk:
        return f"attends within chunks of {chunk} tokens (Llama-4), which the kernel cannot"
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) is not False else None
    if window and longest > window and not kernel_style(varlen_attn)[0]:
        return (f"attends within a sliding window of {window} tokens, and this torch's varlen_attn "
                f"({torch.__version__}) has no window_size")
    return None


@functools.cache
def kernel_runs(device: torch.device) -> bool:
    """Whether torch's varlen kernel runs on this GPU (asked with a 4-token call, once: flash kernels need an Ampere
    or newer GPU). The process's own device: under torchrun a probe on "cuda" would open a context on GPU 0 from
    every rank."""
    try:
        states = torch.zeros(4, 1, 64, dtype=torch.bfloat16, device=device)
        cu_seq = torch.tensor([0, 4], dtype=torch.int32, device=device)
        call_kernel(states, states, states, cu_seq, 4, 0.125, None)
    except (RuntimeError, SFTError):
        return False
    return True


def fastest_attention(model_config: PretrainedConfig, gpu: torch.device | None, half: bool,
                      max_length: int | None) -> tuple[str | None, str]:
    """The attention an unset attn_implementation runs for packed or padding-free batches on CUDA device `gpu`
    (None: the run has none), and why: `varlen` with 16-bit activations (half) where this torch has the kernel, it
    runs on the GPU and it computes this model's attention; else None, transformers' default (sdpa), which isolates
    packed rows with an [L, L] mask per row and computes every block of it."""
    if gpu is None:
        return None, "no CUDA GPU"
    choice, why = gpu_attention(model_config, half, max_length)
    if choice is not None and not kernel_runs(gpu):
        return None, "torch's varlen kernel does not run on this GPU"
    return choice, why


def gpu_attention(model_config: PretrainedConfig, half: bool, max_length: int | None) -> tuple[str | None, str]:
    """fastest_attention on an Ampere or newer GPU, without one at hand (the kernel is not probed): what `sft check`
    tells of a recipe on any machine."""
    if not half:
        return None, "float32 activations: the flash kernel takes bf16 or fp16"
    if TORCH_VARLEN is None:
        return None, f"torch {torch.__version__} has no varlen_attn"
    problem = varlen_problem(model_config, max_length)
    if problem:
        return None, f"the model {problem}"
    return VARLEN, "packed 16-bit batches on a CUDA GPU: torch's flash kernel within each example, no [L, L] mask"


def register() -> None:
    """Make `attn_implementation="varlen"` loadable (idempotent)."""
    if TORCH_VARLEN is None:
        raise SFTError(f"attn_implementation {VARLEN} needs torch.nn.attention.varlen, which this torch "
                       f"({torch.__version__}) does not have. Use sdpa, or a newer torch.")
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    # Flash attention's mask: None without padding (packed-sequence detection needs no [L, L] mask here), else the
    # 2D padding mask, so a padded batch is never run as if it were unpadded.
    AttentionMaskInterface.register(VARLEN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, L, D], key/value [B, Hkv, S, D] -> output
    [B, L, Hq, D]. Causal within each example; a padded batch or a KV-cache step goes through sdpa."""
    if dropout:
        raise SFTError(f"attn_implementation {VARLEN} has no attention dropout, and this model's is {dropout}: set "
                       "the model config's attention_dropout to 0, or use sdpa.")
    if kwargs.get("softcap") is not None:
        raise SFTError(f"attn_implementation {VARLEN} cannot soft-cap attention logits (this model does); use eager.")
    if not getattr(module, "is_causal", True):
        raise SFTError(f"attn_implementation {VARLEN} is causal only; {type(module).__name__} attends both ways.")
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return masked_sdpa(module, query, key, value, attention_mask, scaling, sliding_window)
    batch, _, length, dim = query.shape
    cu_seq, max_len = boundaries(kwargs, batch, length, query.device)
    query, key, value = autocast(query, key, value)
    out = call_kernel(flat(query), flat(key), flat(value), cu_seq, max_len,
                      scaling if scaling is not None else dim ** -0.5, sliding_window)
    return out.view(batch, length, *out.shape[1:]), None


def autocast(*states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The states in autocast's dtype where it is on: rotary embeddings of fp32 hidden states (bf16: true keeps fp32
    weights) hand over fp32 queries and keys with bf16 values. sdpa is cast by autocast itself; the kernel is not."""
    device = states[0].device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return tuple(s.to(torch.get_autocast_dtype(device)) for s in states)
    return states


def flat(states: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B * L, H, D], the kernel's token-major layout."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])


def boundaries(kwargs: dict, batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens int32 [N + 1] over the B * L flattened tokens, longest example) of this batch."""
    cu_seq = kwargs.get("cu_seq_lens_q")
    if cu_seq is not None and kwargs.get("max_length_q") is not None:
        return cu_seq.to(device=device, dtype=torch.int32), int(kwargs["max_length_q"])
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # nothing says otherwise: every row is one example
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device), length
    position_ids = position_ids.expand(batch, length).to(device)
    # sft.data.boundaries' rule (layer 3, which this layer cannot import; tests/test_varlen.py checks they agree):
    # an example starts at each row's first token and wherever positions do not go up by 1.
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    cu_seq = F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=batch * length).to(torch.int32)
    return cu_seq, int((cu_seq[1:] - cu_seq[:-1]).max())  # host syncs: the collator's kwargs avoid them


def call_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor, max_len: int,
                scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal varlen attention of flattened [T, H, D] states, in whichever style this torch's kernel takes."""
    kernel = varlen_attn
    if kernel is TORCH_VARLEN and not (query.is_cuda and query.dtype in HALF):
        raise SFTError(f"attn_implementation {VARLEN} runs torch's flash kernel, which needs a CUDA GPU and bf16 or "
                       f"fp16 activations (bf16: true or dtype: bfloat16); got {query.dtype} on {query.device.type}. "
                       "Use sdpa here.")
    windowed, gqa, scaled = kernel_style(kernel)
    window = sliding_window is not None and max_len > sliding_window  # a window no example outgrows changes nothing
    if window and not windowed:
        raise SFTError(f"This model attends within a sliding window of {sliding_window} tokens, longer examples "
                       f"({max_len} tokens) exist, and this torch's varlen_attn ({torch.__version__}) has no "
                       "window_size. Use sdpa or flex_attention, or a torch whose varlen_attn takes window_size.")
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)  # transformers' repeat_kv
    if windowed:  # flash's window counts the keys before the query; transformers' sliding_window the query too
        options: dict[str, Any] = {"window_size": (sliding_window - 1, 0) if window else (-1, 0)}
        if groups > 1 and gqa:
            options["enable_gqa"] = True
    else:
        options = {"is_causal": True}
    if scaled:
        options["scale"] = scale
    elif not math.isclose(scale, query.shape[-1] ** -0.5):
        query = query * (scale * math.sqrt(query.shape[-1]))  # the kernel scales by 1/sqrt(D) itself
    return kernel(query, key, value, cu_seq, cu_seq, max_len, max_len, **options)


def masked_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None,
                sliding_window: int | None) -> tuple[torch.Tensor, None]:
    """A padded batch (2D mask) or a KV-cache step (fewer queries than keys): transformers' sdpa with the causal,
    window and padding mask spelled out (a 4D mask given by the caller is used as it is)."""
    if attention_mask is None or attention_mask.dim() == 2:
        attention_mask = dense_mask(attention_mask, query.shape[2], key.shape[2], sliding_window, query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)


def dense_mask(padding: torch.Tensor | None, q_len: int, k_len: int, window: int | None,
               device: torch.device) -> torch.Tensor:
    """[B or 1, 1, Q, K] bool: query i (the last Q of K positions) sees the keys up to itself, within `window`,
    that are not padding."""
    row = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    col = torch.arange(k_len, device=device)[None, :]
    allowed = col <= row
    if window is not None:
        allowed &= col > row - window
    allowed = allowed[None, None]
    if padding is not None:
        allowed = allowed & padding[:, None, None, -k_len:].to(device=device, dtype=torch.bool)
    return allowed | (col == row)  # a (left-)padding query sees itself: no fully masked row, no NaN
