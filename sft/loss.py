"""Causal-LM loss that never materialises full-vocabulary logits for the whole batch.

The LM head dominates SFT compute and memory on small and mid-size models (a 32k vocabulary x 4k tokens of fp32
logits is 512 MB, plus its gradient). Here the head runs only at positions whose next token is trained, in chunks,
and each chunk's gradients are computed in the forward pass (as fused linear-cross-entropy kernels do), so peak
memory holds one chunk of logits and the head costs exactly its three matmuls, with no recomputation.
"""

import torch
import torch.nn.functional as F
from torch import nn

from sft.encode import IGNORE_INDEX

MIN_CHUNK_ROWS = 128  # below this the head matmuls get inefficient
CHUNK_ELEMENTS = 1 << 23  # logits per chunk (32 MB in fp32): a few rows for big vocabularies, more for small ones
# Architectures whose logits are exactly lm_head(decoder(x)): no soft-capping or scaling after the head.
PLAIN_HEAD_MODELS = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma",
                     "olmo", "olmo2", "starcoder2"}


class LinearCrossEntropy(torch.autograd.Function):
    """sum(cross_entropy(hidden @ weight.T, targets)) / normalizer, with gradients computed chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, normalizer: torch.Tensor,
                chunk: int) -> torch.Tensor:
        need_weight_grad = weight.requires_grad
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            rows = torch.arange(t.shape[0], device=t.device)
            logits = (h @ weight.T).float()
            target_logit = logits[rows, t]
            # One exp pass, in place: logits become softmax probabilities = d(loss)/d(logits) + onehot.
            peak = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(peak).exp_()
            sums = probs.sum(dim=-1, keepdim=True)
            total += (peak.squeeze(1) + sums.squeeze(1).log() - target_logit).sum()
            grad_logits = probs.div_(sums)
            grad_logits[rows, t] -= 1.0
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[start:start + chunk] = grad_logits @ weight
            if need_weight_grad:
                grad_weight += (grad_logits.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight if need_weight_grad else torch.empty(0), normalizer)
        ctx.need_weight_grad = need_weight_grad
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        grad_hidden, grad_weight, normalizer = ctx.saved_tensors
        scale = grad_output / normalizer
        weight_grad = (grad_weight * scale).to(grad_hidden.dtype) if ctx.need_weight_grad else None
        return grad_hidden * scale.to(grad_hidden.dtype), weight_grad, None, None, None


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether `model` is a causal LM whose logits are a plain linear head over its decoder's output."""
    config = model.config
    head = model.get_output_embeddings()
    router_loss = getattr(config, "output_router_logits", False)  # MoE aux loss is added after the head
    return (not config.is_encoder_decoder and config.model_type in PLAIN_HEAD_MODELS and not router_loss
            and type(head) is nn.Linear and head.bias is None)


def chunked_causal_loss(model: nn.Module, inputs: dict, normalizer: torch.Tensor | int | None) -> torch.Tensor:
    """Sum of next-token cross entropy over trained positions / normalizer (default: their count)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    inputs.pop("num_items_in_batch", None)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    picked_hidden = hidden[:, :-1][keep]
    picked_targets = targets[keep]
    if normalizer is None:
        normalizer = keep.sum()
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).clamp(min=1)
    weight = model.get_output_embeddings().weight
    chunk = max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // weight.shape[0])
    return LinearCrossEntropy.apply(picked_hidden, weight, picked_targets, normalizer, chunk)


def reference_causal_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | int) -> torch.Tensor:
    """The plain formula the chunked loss must equal: summed shifted cross entropy / normalizer."""
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss / normalizer
