"""The token losses SFTTrainer computes: the chunked causal-LM loss, the step-normalised encoder-decoder loss, and
evaluation's per-token losses summed into the exact eval loss (TokenLoss and EvalTokenSums hold one trainer's).

The chunked causal-LM loss never materialises full-vocabulary logits for the whole batch: the model's forward runs
its decoder, then the head only at positions whose next token is trained, chunk by chunk, gradients computed in the
forward (sft.training.linear_cross_entropy, the kernel).

`loss_kernel: fused` runs LinearCrossEntropy with each chunk's softmax and gradient compiled by inductor into fused
kernels (the same loss, within float32 rounding); `loss_kernel: auto` runs it on a CUDA GPU (measured faster there),
the eager step elsewhere. `loss_kernel: liger` hands the same trained rows to Liger's fused
linear cross-entropy (Triton, CUDA only) instead of LinearCrossEntropy: summed, divided by the same normaliser, with
the same label smoothing formula, fp32 weight-gradient accumulation as here, no z-loss and no softcap. Eval always
uses sft's own chunked token losses.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PretrainedConfig, PreTrainedModel
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.utils import ModelOutput

from sft.config.arguments import SFTConfig
from sft.config.names import CHUNKED_LOSS_KERNELS
from sft.data.boundaries import starts
from sft.data.encode import IGNORE_INDEX
from sft.errors import SFTError
from sft.models.adapters import head_layer, head_weight, unwrapped
from sft.models.families import has_plain_head
from sft.training.linear_cross_entropy import (
    LinearCrossEntropy,
    chunk_rows,
    chunked_token_losses,
    fused_logit_gradients,
)

log = logging.getLogger(__name__)


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether `model` is a causal LM whose logits are a plain linear head over its decoder's output."""
    if not isinstance(model, PreTrainedModel):  # SFTTrainer also takes plain nn.Modules, as Trainer does
        return False
    head = head_layer(model.get_output_embeddings())  # also under peft's wrappers (LoRA with new tokens)
    return has_plain_head(model.config) and type(head) is nn.Linear and head.bias is None


@dataclass
class TrainedTokensOutput(ModelOutput):
    """What the chunked forward returns: the loss, and in eval each position's token loss (0 where untrained)."""

    loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None


def attach_chunked_loss(model: nn.Module, label_smoothing: float = 0.0, liger: Callable | None = None,
                        fused: bool = False) -> bool:
    """Make the causal LM inside `model` (a PEFT model's base too) compute its loss with labels chunk-wise in its
    own forward; returns whether it applies. `liger` (liger_linear_cross_entropy's function) computes the training
    loss instead of LinearCrossEntropy; `fused` runs LinearCrossEntropy's compiled chunk step. Attaching again
    replaces the earlier settings.

    The forward is replaced on the instance, so every wrapper that calls the model (DDP, FSDP2, DeepSpeed, PEFT,
    accelerate's autocast, torch.compile) runs it: parameters are gathered and gradients synchronised as for any
    forward. Without labels (generate) the model's own forward runs unchanged.
    """
    lm = unwrapped(model)
    if not supports_chunked_loss(lm):
        return False
    attached = getattr(lm.forward, "chunked_loss", False)
    original = lm.forward.__wrapped__ if attached else lm.forward

    @functools.wraps(original)  # keeps the signature: the Trainer reads it to keep dataset columns
    def forward(*args: Any, **kwargs: Any) -> Any:
        return chunked_forward(lm, *args, original=original, smoothing=label_smoothing, liger=liger,
                               fused=fused, **kwargs)

    forward.chunked_loss = True
    lm.forward = forward
    if is_deepspeed_zero3_enabled() and not attached:
        import deepspeed

        # The head's weights are read here, not through lm_head's forward: ZeRO-3 gathers them for this module.
        for parameter in lm.get_output_embeddings().parameters():
            deepspeed.zero.register_external_parameter(lm, parameter)
    return True


def trained_index(keep: torch.Tensor, host_count: tuple[int, ...] | None) -> torch.Tensor:
    """Flat indices of the True entries of `keep` ([B, T]), in row-major order.

    `host_count` is (count, B, T) as the collator counted on the host (HostCount). With it the output size is
    known without reading the device (nonzero_static); boolean indexing or nonzero would make the host wait for
    the GPU on every forward, and their backward once more. Without it (or for another shape, e.g. sequences
    sharded by context parallelism) this falls back to nonzero.
    """
    flat = keep.flatten()
    if host_count is not None and tuple(host_count[1:]) == tuple(keep.shape) and 0 <= host_count[0] <= flat.numel():
        return torch.nonzero_static(flat, size=host_count[0]).squeeze(1)
    return flat.nonzero().squeeze(1)


def chunked_forward(self: nn.Module, *args: Any, original: Callable, smoothing: float, liger: Callable | None = None,
                    fused: bool = False, labels: torch.Tensor | None = None,
                    num_items_in_batch: torch.Tensor | int | None = None, full_logits: bool = False,
                    trained_targets: tuple[int, ...] | None = None,
                    **kwargs: Any) -> Any:
    """The model's forward; with labels, the decoder plus the head at trained positions only (see module doc).

    `full_logits=True` (predictions wanted, e.g. Trainer.predict) runs the model's own forward.
    `trained_targets`: the host-side count of trained targets (sft.data.collators.HostCount), so that selecting
    them does not wait for the GPU.
    """
    if labels is None or full_logits:
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return original(*args, labels=labels, **kwargs)
    for key in ("logits_to_keep", "return_dict", "use_cache"):
        kwargs.pop(key, None)
    hidden = self.get_decoder()(*args, use_cache=False, **kwargs).last_hidden_state
    targets = loss_targets(labels, shifted=True)
    keep = targets != IGNORE_INDEX
    weight = head_weight(gathered_head(self.get_output_embeddings()))
    chunk = chunk_rows(weight.shape[0])
    normalizer = keep.sum() if num_items_in_batch is None else num_items_in_batch
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).clamp(min=1)
    index = trained_index(keep, trained_targets)
    # Position t of row b predicts target (b, t): skip each row's last hidden state (it predicts nothing).
    picked_hidden = hidden.flatten(0, 1).index_select(0, index + index // max(targets.shape[1], 1))
    picked_targets = targets.flatten().index_select(0, index)
    if torch.is_grad_enabled():
        if liger is not None and picked_targets.numel():  # no trained row: sft's own gives the zero loss and gradients
            return TrainedTokensOutput(loss=liger_loss(liger, picked_hidden, weight, picked_targets, normalizer,
                                                       smoothing))
        loss = eager_linear_cross_entropy(picked_hidden, weight, picked_targets, normalizer, chunk, smoothing, fused)
        return TrainedTokensOutput(loss=loss)
    token_losses = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    picked_losses = eager_token_losses(picked_hidden, weight, picked_targets, chunk)
    token_losses.view(-1).index_copy_(0, index, picked_losses)
    return TrainedTokensOutput(loss=token_losses.sum() / normalizer, token_losses=token_losses)


def gathered_head(head: nn.Module) -> nn.Module:
    """The LM head with its whole weight. FSDP2 gathers a unit's parameters in the unit's forward, which the chunked
    loss does not call: accelerate shards the head with the final norm (gathered in the norm's forward), but as a
    unit of its own where it finds no norm beside it (a PEFT model), where the weight stayed a shard (a DTensor:
    "aten.mm.default got mixed torch.Tensor and DTensor"). FSDP2's end-of-backward callback reduces its gradient
    and reshards it, as for a unit whose forward ran."""
    if isinstance(head, FSDPModule):
        head.unshard()  # no-op when already gathered
    return head


def liger_loss(liger: Callable, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               normalizer: torch.Tensor, smoothing: float) -> torch.Tensor:
    """What LinearCrossEntropy computes, by Liger's fused linear cross-entropy: the summed loss of the trained rows
    (none ignored) / normalizer; weight gradients accumulated in fp32 as here (Liger's default is the weight's
    dtype, bf16 in a bf16 run); Liger's label smoothing is the formula LinearCrossEntropy uses."""
    total = liger(hidden, weight, targets, ignore_index=IGNORE_INDEX, label_smoothing=smoothing, reduction="sum",
                  accum_dtype=torch.float32)
    return total.float() / normalizer


def liger_linear_cross_entropy(device: torch.device) -> Callable:
    """liger_kernel's liger_fused_linear_cross_entropy for training on `device`; SFTError (what to do) where it
    cannot run: liger-kernel missing or not importing (Triton), or a device other than a CUDA GPU."""
    if torch.device(device).type != "cuda":
        raise SFTError(f"loss_kernel: liger needs a CUDA GPU (Liger's kernels are Triton), and this run trains on "
                       f"{torch.device(device).type}. Set loss_kernel: auto to use sft's own chunked loss.")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except (ImportError, RuntimeError) as error:  # not installed, or Triton failing to initialise
        raise SFTError(f"loss_kernel: liger needs liger-kernel, which does not import here ({type(error).__name__}: "
                       f"{error}). Install it (pip install liger-kernel) or set loss_kernel: auto.") from None
    return liger_fused_linear_cross_entropy


def fused_step_runs(device: torch.device | str) -> bool:
    """Whether `loss_kernel: auto` runs the chunked loss's fused (compiled) chunk step on `device`: a CUDA GPU where
    inductor has Triton for it (compute capability 7.0 or newer) and a tiny step compiles there. On an H100 the
    Qwen2.5-0.5B head's loss, forward and backward at half of 8 x 2048 rows trained, took 25.1 ms fused and 44.7 ms
    eager, Liger's 106.3, and the whole step ran 6.6% faster (BENCHMARKS.md); on CPU the fused step was slower (37 vs
    27 ms, `bench_loss.py --small`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    from torch.utils._triton import has_triton_package

    index = device.index if device.index is not None else torch.cuda.current_device()
    return (has_triton_package() and torch.cuda.get_device_capability(index)[0] >= 7
            and fused_step_compiles(torch.device("cuda", index)))


def chunked_loss_applies(config: SFTConfig, arch: PretrainedConfig) -> bool:
    """Whether SFTTrainer attaches the chunked loss (supports_chunked_loss, from the config alone): plain heads
    (sft.models.families), under every preset, in training and eval. The planner and `sft check` read it."""
    return config.chunked_loss and has_plain_head(arch)


def loss_on_a_gpu(config: SFTConfig, model_config: PretrainedConfig) -> str:
    """What computes this recipe's training loss on a GPU, and why (`sft check` reports it on any machine: its smoke
    run on CPU runs the eager chunk step under auto); `model_config` is the real model's."""
    if not chunked_loss_applies(config, model_config):
        why = ("chunked_loss: false" if not config.chunked_loss
               else "no plain linear head: the chunked loss does not apply")
        return f"the model's own loss over full logits ({why})"
    return {"liger": "Liger's fused linear cross-entropy (the recipe's)",
            "fused": "the chunked loss, its chunk step fused (the recipe's)",
            "chunked": "the chunked loss, its eager chunk step (the recipe's)"}.get(
        config.loss_kernel, "the chunked loss, its chunk step fused (auto, on a CUDA GPU with Triton; eager where "
                            "that does not compile)")


@functools.cache
def fused_step_compiles(device: torch.device) -> bool:
    """Whether the fused chunk step compiles and runs on `device` (Triton builds its launchers with the machine's C
    compiler, which slim images lack): auto then keeps the eager step, saying why, instead of failing at the first
    step as an explicit `loss_kernel: fused` does. About a second, once per process."""
    hidden = torch.ones(2, 8, device=device, dtype=torch.bfloat16)
    try:
        fused_logit_gradients(hidden, torch.ones(16, 8, device=device, dtype=torch.bfloat16),
                              torch.zeros(2, dtype=torch.long, device=device), 16, 0.0)
    except SFTError as error:
        log.warning("loss_kernel auto: the eager chunk step runs (the same loss), as the fused one cannot here: %s",
                    error)
        return False
    return True


# Under torch_compile the model's forward is compiled, and this loss with it unless kept out: dynamo unrolls the
# chunk loop, so compile time grows with the chunk count (32 chunks of a tiny Llama on CPU: first step 74 s compiled
# in, 13 s kept out; 64-128 chunks at 0.5B-8B shapes and 8 x 2048 tokens), while each chunk is matmuls and an exp
# that compiling does not speed up. So the loss runs eagerly inside a compiled forward (one graph break).
eager_linear_cross_entropy = torch.compiler.disable(LinearCrossEntropy.apply)
eager_token_losses = torch.compiler.disable(chunked_token_losses)


def loss_targets(labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """The labels a loss scores ([B, T] rows): a causal LM's next-token targets labels[:, 1:] when `shifted` (position
    t predicts label t + 1, so no row's first label is ever a target; packed rows' example starts are -100 already,
    sft.data.collators), an encoder-decoder's every label otherwise. HostCount (sft.data, below this layer) counts
    the same labels[:, 1:]."""
    return labels[..., 1:] if shifted else labels


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """Each position's cross entropy (0 where untrained), next-token when `shifted`."""
    if shifted:
        logits, labels = logits[:, :-1], loss_targets(labels, shifted)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(labels.shape)


def seq2seq_token_loss(model: nn.Module, inputs: dict, normalizer: torch.Tensor | int | None,
                       smoothing: float = 0.0) -> torch.Tensor:
    """Summed decoder cross entropy / normalizer (the step's trained tokens), as the causal loss is normalised.

    transformers' T5/BART take num_items_in_batch but still return a per-batch mean, which over-weights short
    micro-batches under gradient accumulation and scales gradients by the accumulation steps. Label smoothing is
    PyTorch's: (1 - eps) * nll + eps * mean over the vocabulary of -log p per token, LinearCrossEntropy's formula.
    """
    labels = inputs["labels"]
    logits = model(**inputs).logits
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().to(logits.device),
                            ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=smoothing)
    if normalizer is None:
        normalizer = (labels != IGNORE_INDEX).sum()
    return total / torch.as_tensor(normalizer, dtype=torch.float32, device=total.device).clamp(min=1)


class TokenLoss:
    """One trainer's loss choices, made once: the chunked forward where the model has a plain head (it then applies
    label smoothing itself: transformers' LabelSmoother would need the full logits), computed by sft's
    LinearCrossEntropy (kernel "fused": with its compiled chunk step) or, with kernel "liger", Liger's fused linear
    cross-entropy; the step-normalised decoder loss for encoder-decoder training, which applies label smoothing too.
    Kernel "auto" is the fused step where fused_step_runs, else the eager one ("chunked")."""

    def __init__(self, model: nn.Module, chunked: bool, label_smoothing: float, kernel: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        liger = liger_linear_cross_entropy(device) if kernel == "liger" else None
        fused = kernel == "fused" or kernel == "auto" and fused_step_runs(device)
        self.chunked = chunked and attach_chunked_loss(model, label_smoothing, liger, fused=fused)
        if kernel in CHUNKED_LOSS_KERNELS and not self.chunked:
            raise SFTError(f"loss_kernel: {kernel} computes the chunked loss, which needs chunked_loss: true and a "
                           f"causal LM with a plain linear output head ({type(unwrapped(model)).__name__} here). "
                           "Set loss_kernel: auto.")
        self.kernel = "model" if not self.chunked else "liger" if liger else "fused" if fused else "chunked"
        self.smoothing = label_smoothing
        self.encoder_decoder = bool(getattr(getattr(unwrapped(model), "config", None), "is_encoder_decoder", False))

    @property
    def smooths(self) -> bool:
        """Whether sft's loss applies label smoothing, so the Trainer's LabelSmoother must stay off: the chunked
        forward, and the encoder-decoder loss (the LabelSmoother takes the labels out of the batch, and without them
        the decoder has no input). Causal LMs without the chunked loss keep the Trainer's (the same formula and
        normaliser)."""
        return self.chunked or self.encoder_decoder

    def seq2seq(self, model: nn.Module, inputs: dict, num_items_in_batch: torch.Tensor | int | None,
                processes: int = 1) -> torch.Tensor:
        """seq2seq_token_loss with the run's label smoothing, times `processes` where num_items_in_batch counts every
        process's tokens (the Trainer then divides the gradients by the process count)."""
        loss = seq2seq_token_loss(model, inputs, num_items_in_batch, self.smoothing)
        return loss * processes if processes != 1 else loss

    def prediction_inputs(self, inputs: dict[str, Any], prediction_loss_only: bool) -> dict[str, Any]:
        """The batch for a prediction step: predict() / compute_metrics want logits, which the chunked forward
        returns only when asked."""
        return {**inputs, "full_logits": True} if self.chunked and not prediction_loss_only else inputs


class EvalTokenSums:
    """Sums of token losses and trained tokens over one evaluation, so eval loss is a token mean however rows are
    grouped.

    Multi-process, per-row sums are gathered with gather_for_metrics, which drops the rows accelerate repeats to
    even out the last batch. A flattened (padding-free) batch is split back into its examples; when those are packed
    rows they cannot be told apart, and the repeats (at most one batch) count.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.sums = torch.zeros(2)
        self.split_examples = self.dedup = False  # decided per evaluation (start)

    def start(self, flattened: bool, packed: bool, device: torch.device | str) -> None:
        """Zero the sums for an evaluation over flattened (padding-free) and/or packed batches."""
        self.sums = torch.zeros(2, device=device)
        self.split_examples = flattened and not packed
        self.dedup = self.accelerator.num_processes > 1 and not (flattened and packed)

    def add(self, outputs: Any, inputs: dict[str, Any], shifted: bool) -> None:
        """Add one eval batch: the chunked forward's token_losses, else the cross entropy of the model's logits."""
        labels = inputs["labels"]
        token_losses = outputs.get("token_losses") if isinstance(outputs, dict) else None
        if token_losses is None:  # models without the chunked forward return logits
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
            token_losses = token_cross_entropy(logits, labels, shifted)
        targets = loss_targets(labels, shifted)
        trained = targets != IGNORE_INDEX
        rows = torch.arange(targets.shape[0], device=targets.device)[:, None].expand_as(targets)
        n_rows = targets.shape[0]
        if self.split_examples:
            rows = starts(inputs["position_ids"]).cumsum(-1)[:, 1:] - 1  # example of each target token
            # Gathered sums need one row per example (a sync, beside the gather's own); a local sum only a bound.
            n_rows = int(rows.max()) + 1 if self.dedup else rows.shape[-1] + 1
        # Untrained positions add zeros: no boolean selection, whose size would make the host wait for the GPU.
        values = torch.stack([torch.where(trained, token_losses.float(), 0.0), trained.float()], dim=-1)
        sums = torch.zeros(n_rows, 2, device=values.device).index_add_(0, rows.flatten(), values.flatten(0, 1))
        if self.dedup:
            sums = self.accelerator.gather_for_metrics(sums)
        self.sums += sums.sum(0).to(self.sums.device)

    def mean(self) -> float | None:
        """The mean loss over every process's trained tokens (None when none was trained); a collective."""
        sums = self.sums if self.dedup else self.accelerator.reduce(self.sums, reduction="sum")
        return float(sums[0] / sums[1]) if sums[1] > 0 else None
