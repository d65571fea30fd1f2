"""The chunked causal-LM loss's kernel: LinearCrossEntropy, the summed cross entropy of a linear head at the given
rows, computed chunk by chunk, and its eval twin chunked_token_losses (sft.training.loss runs them in the model's
forward, at the trained positions only).

The head never materialises full-vocabulary logits for the whole batch. The LM head dominates SFT compute and memory
on small and mid-size models (a 32k vocabulary x 4k tokens of fp32 logits is 512 MB, plus its gradient). Each chunk's
gradients are computed in the forward pass (as fused linear-cross-entropy kernels do), so peak memory holds one chunk
of logits and the head costs exactly its three matmuls, with no recomputation.
"""

import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError

from sft.errors import SFTError
from sft.models.loading import EMBEDDING_MULTIPLE

MIN_CHUNK_ROWS = 128  # below this the head matmuls get inefficient
# Logits per chunk: 256 MB in fp32 (441 rows of Qwen2.5's 151,936-token vocabulary, 523 of Llama-3's 128,256, 2048 of
# a 32k one). Each chunk adds its weight-gradient product into the fp32 gradient (about 20 bytes moved per head weight,
# whatever its row count), so small chunks make that memory traffic dominate the head on a GPU: a Qwen2.5-0.5B
# micro-batch of 8 x 2048 (8,936 trained rows) moved 190 GB in 70 chunks of 128 rows (32 MB; about 63 ms of its
# 334 ms H100 step), 57 GB in 21 of 441. On CPU the head took 46.5 s at 512 rows, 45.5 s at 2048, 60.7 s at 128
# (BENCHMARKS.md). At the peak a chunk holds 6 bytes a logit: 0.4 GB at Qwen2.5's vocabulary (128 rows held 0.2 GB,
# at 12 bytes a logit before each chunk's tensors were freed ahead of the next's).
CHUNK_ELEMENTS = 1 << 26
# cuBLAS runs its tensor-core GEMMs on 16-byte-aligned leading dimensions only. The logits' row is the head's row
# count, so a bf16 head whose rows are not a multiple of 8 (GPT-2's 50,257, Granite-3's 49,155, a vocabulary grown by
# added tokens under LoRA, Qwen2.5's cut to its tokenizer's 151,665) ran its three matmuls on sm75 `align1` CUTLASS
# kernels on an H100: 61.5 of a Qwen2.5-0.5B step's 122 ms of matmuls (BENCHMARKS.md). Such a head is copied with zero
# rows to a multiple of 64 (a few hundred MB, once per step) and its extra logits are sliced off. CPU BLAS gains too:
# the float32 loss of that head, 2048 rows, took 12.9 s padded and 16.0 s not (2 cores, 2026-11-27).
HEAD_ALIGN_BYTES = 16


class LinearCrossEntropy(torch.autograd.Function):
    """sum(cross_entropy(hidden @ weight.T, targets)) / normalizer, with gradients computed chunk by chunk.

    With label smoothing eps each token's loss is (1 - eps) * nll + eps * mean over the vocabulary of -log p, the
    formula of transformers' LabelSmoother.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, normalizer: torch.Tensor,
                chunk: int, smoothing: float = 0.0, fused: bool = False) -> torch.Tensor:
        need_weight_grad = weight.requires_grad
        gradients = fused_logit_gradients if fused else logit_gradients
        vocab = weight.shape[0]
        head = aligned_head(weight)  # the weight itself, or zero rows added: their logits are sliced off
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(head.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            grad_logits, loss = gradients(h, head, targets[start:start + chunk], vocab, smoothing)
            total += loss
            grad_hidden[start:start + chunk] = grad_logits @ head
            if need_weight_grad:
                add_weight_grad(grad_weight, grad_logits, h)
            del grad_logits  # else the next chunk's logits are made while this chunk's gradient is still live
        del head
        ctx.save_for_backward(grad_hidden, grad_weight[:vocab] if need_weight_grad else torch.empty(0), normalizer)
        ctx.need_weight_grad = need_weight_grad
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        grad_hidden, grad_weight, normalizer = ctx.saved_tensors
        scale = grad_output / normalizer
        weight_grad = (grad_weight * scale).to(grad_hidden.dtype) if ctx.need_weight_grad else None
        return grad_hidden * scale.to(grad_hidden.dtype), weight_grad, None, None, None, None, None


def aligned_head(weight: torch.Tensor) -> torch.Tensor:
    """The head weight as the chunk matmuls read it: `weight` itself, or, where its rows in the matmuls' dtype are
    not 16-byte aligned, a copy in that dtype with zero rows up to a multiple of 64 (HEAD_ALIGN_BYTES).

    The copy is made in autocast's dtype where autocast would cast a float32 weight: a copy is no leaf, so autocast
    would cast it again for every chunk. Its gradient rows past the vocabulary stay zero and are dropped.
    """
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if weight.dtype == torch.float32 and torch.is_autocast_enabled(device) \
        else weight.dtype
    rows = head_rows(weight.shape[0], dtype.itemsize)
    if rows == weight.shape[0]:
        return weight
    head = weight.new_zeros((rows, weight.shape[1]), dtype=dtype)
    head[:weight.shape[0]] = weight
    return head


def head_rows(vocab: int, itemsize: int = 2) -> int:
    """Rows the chunked loss's matmuls run the head at: `vocab`, or the next multiple of 64 where `vocab` rows of
    `itemsize`-byte elements are not 16-byte aligned (the planner counts the same copy, in 16-bit)."""
    if vocab * itemsize % HEAD_ALIGN_BYTES == 0:
        return vocab
    return -(-vocab // EMBEDDING_MULTIPLE) * EMBEDDING_MULTIPLE


def logit_gradients(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, vocab: int,
                    smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's logits (hidden @ head.T) and their d(summed cross entropy)/d(logits), in the head's dtype and as
    wide as its rows (zero past `vocab`: a padded head's extra columns add nothing to either gradient), and the
    chunk's summed loss in float32.

    The matmul's product is freed once cast to float32 (6 bytes a logit at the peak, as the planner counts). One exp
    pass, in place: the float32 logits become softmax probabilities = d(loss)/d(logits) + onehot.
    """
    rows = torch.arange(targets.shape[0], device=targets.device)
    logits = (hidden @ head.T)[:, :vocab].float()
    target_logit = logits[rows, targets]
    mean_logit = logits.mean(dim=-1) if smoothing else None
    peak = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(peak).exp_()
    sums = probs.sum(dim=-1, keepdim=True)
    log_norm = peak.squeeze(1) + sums.squeeze(1).log()
    total = (log_norm - target_logit).sum() * (1 - smoothing)
    if smoothing:  # mean over the vocabulary of -log p = log_norm - mean logit
        total = total + (log_norm - mean_logit).sum() * smoothing
    grad = probs.div_(sums)
    grad[rows, targets] -= 1.0 - smoothing
    if smoothing:
        grad -= smoothing / vocab
    if vocab == head.shape[0]:
        return grad.to(head.dtype), total
    out = grad.new_empty((grad.shape[0], head.shape[0]), dtype=head.dtype)
    out[:, vocab:] = 0
    out[:, :vocab] = grad
    return out, total


def fusable_logit_gradients(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, vocab: int,
                            smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logit_gradients written for inductor to fuse (`loss_kernel: fused` compiles it): no in-place ops or indexed
    writes, the target's column and the padded columns as comparisons with the column index, so the max, the sum of
    exponentials, the target's logit and the gradient each read the chunk's 16-bit logits in the same loops.

    Eager, logit_gradients moves about 46 bytes a logit (the float32 copy, then five passes over it and the cast
    back: 62 GB for a Qwen2.5-0.5B batch of 8 x 2048 at half its rows trained, ~25 ms of an H100's bandwidth);
    fused, about 8 (two or three reads of the 16-bit logits, one write of the gradient).
    """
    logits = (hidden @ head.T).float()
    column = torch.arange(head.shape[0], device=logits.device)
    is_target = column == targets[:, None]
    real = column < vocab  # a padded head's extra columns: no probability, zero gradient
    logits = torch.where(real, logits, float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    exps = (logits - peak).exp()
    sums = exps.sum(dim=-1, keepdim=True)
    log_norm = (peak + sums.log()).squeeze(1)
    target_logit = torch.where(is_target, logits, 0.0).sum(dim=-1)
    total = (log_norm - target_logit).sum() * (1 - smoothing)
    grad = exps / sums - torch.where(is_target, 1.0 - smoothing, 0.0)
    if smoothing:
        mean_logit = torch.where(real, logits, 0.0).sum(dim=-1) / vocab
        total = total + (log_norm - mean_logit).sum() * smoothing
        grad = torch.where(real, grad - smoothing / vocab, 0.0)
    return grad.to(head.dtype), total


compiled_logit_gradients = torch.compile(fusable_logit_gradients)


def fused_logit_gradients(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, vocab: int,
                          smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled chunk step; SFTError saying what to do where it cannot compile (no C/C++ compiler, no Triton),
    rather than inductor's traceback at the first step."""
    # One graph for every chunk: rows vary (the last chunk, each step's trained count), so they are compiled dynamic;
    # the head's shape stays static, as each run has one.
    torch._dynamo.maybe_mark_dynamic(hidden, 0)
    torch._dynamo.maybe_mark_dynamic(targets, 0)
    try:
        return compiled_logit_gradients(hidden, head, targets, vocab, smoothing)
    except (BackendCompilerFailed, InductorError) as error:
        cause = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise SFTError(f"loss_kernel: fused could not compile its chunk step with torch.compile ({cause}). It needs "
                       "a working C/C++ compiler on CPU, Triton on a GPU. Set loss_kernel: chunked to train with sft's "
                       "eager chunk step (the same loss).") from None


def add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ hidden in float32.

    On CUDA cuBLAS accumulates the half-precision product straight into the float32 gradient (addmm's out_dtype):
    on an H100 the Llama-3.2-1B head's loss, forward and backward, took 50 instead of 70 ms at half the rows trained
    (BENCHMARKS.md, scripts/bench_loss.py's chunked-cast-add: the product made in bf16, cast, then added, as on CPU,
    where addmm has no out_dtype). Float32 inputs under autocast (float32 weights with `bf16: true`, as the shipped
    full fine-tune recipes load them) are multiplied in autocast's dtype, as autocast's own matmul would.
    """
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else grad_logits.dtype
    if grad_weight.is_cuda and dtype in (torch.bfloat16, torch.float16):
        torch.addmm(grad_weight, grad_logits.T.to(dtype), hidden.to(dtype), out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += (grad_logits.T @ hidden).float()


def chunk_rows(vocab_size: int) -> int:
    """Rows of logits per chunk for a vocabulary (the planner and the simulated step use the same rule)."""
    return max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // vocab_size)


@torch.no_grad()
def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each row's cross entropy (fp32), one chunk of logits at a time: eval never holds full-vocabulary logits."""
    out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    head = aligned_head(weight)
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start:start + chunk] @ head.T)[:, :weight.shape[0]].float()
        out[start:start + chunk] = F.cross_entropy(logits, targets[start:start + chunk], reduction="none")
        del logits  # freed before the next chunk's are made
    return out
