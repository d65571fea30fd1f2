"""Divergence is a failure: the first non-finite loss or gradient norm stops training, and nothing is saved after it.

The Trainer's logging_nan_inf_filter replaces a NaN loss by the running mean in its logs, so a diverged run would log
finite (even zero) losses and save NaN weights as its result. This callback sees every step's loss instead (the
SFT trainer hands it over from training_step), stops at the end of the first bad step, and cancels the checkpoint
and evaluation that step would have triggered, so the newest checkpoint on disk is the last good one.
"""

import math
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint


def host_values(*values: torch.Tensor | float) -> list[float]:
    """The scalars as Python floats, device tensors read in one transfer (one wait for the device)."""
    # FSDP2's gradient norm is a DTensor (clip_grad_norm_ over sharded gradients), which refuses .tolist(): read its
    # full value (replicated: no communication) like any tensor.
    values = tuple(v.full_tensor() if isinstance(v, DTensor) else v for v in values)
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if device is None:
        return [float(v) for v in values]
    # torch.full, not torch.tensor: a host-to-device copy of a Python number would wait for the device too.
    stacked = torch.stack([v.detach().float().reshape(()).to(device) if isinstance(v, torch.Tensor)
                           else torch.full((), float(v), device=device) for v in values])
    return stacked.tolist()


class DivergenceGuard(TrainerCallback):
    """Stops at the first optimizer step whose loss or gradient norm is not finite."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self._step_loss = 0.0
        self._grad_norm = 0.0
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the last good step
        self.bad: tuple[int, str] | None = None  # (step, what was not finite)

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (already scaled for gradient accumulation); the step's loss is their sum.

        The sum stays on the loss's device: reading it here would make the host wait for the GPU on every
        micro-step. on_step_end reads it, with the gradient norm, once per optimizer step.
        """
        self._step_loss = self._step_loss + loss.detach()

    def add_grad_norm(self, norm: torch.Tensor | float | None, fp16: bool) -> None:
        """The step's gradient norm as the Trainer computed it (SFTMixin._get_grad_norm): before clipping, through
        accelerate, so FSDP and ZeRO norms count too. fp16's loss scaler skips steps with infinite gradients on
        purpose; that is not divergence."""
        if norm is not None and not fp16:
            self._grad_norm = norm  # a device tensor: read once at the step's end

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        """Read the step's loss and gradient norm: sft's one wait for the GPU per optimizer step (the decision to
        stop, and not to save, needs their values before the next step starts)."""
        loss, norm = host_values(self._step_loss, self._grad_norm)
        self._step_loss, self._grad_norm = 0.0, 0.0
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite and control.should_save:  # belt and braces: never save weights that are not finite
            finite = all(bool(torch.isfinite(p).all()) for p in kwargs["model"].parameters())
        if not self._agree(finite):
            what = (f"the loss is {loss}" if not math.isfinite(loss)
                    else f"the gradient norm is {norm} at loss {loss:.4g}" if not math.isfinite(norm)
                    else "the weights are not finite")
            self._stop(state.global_step, what, control)
        elif self.bad is None:
            self.last_finite = (state.global_step, loss)
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> TrainerControl:
        if self.bad is not None:  # the epoch-end save/eval would write the diverged weights
            control.should_save = control.should_evaluate = False
        return control

    def _stop(self, step: int, what: str, control: TrainerControl) -> None:
        self.bad = self.bad or (step, what)
        control.should_training_stop = True
        control.should_save = control.should_evaluate = False

    def _agree(self, finite: bool) -> bool:
        """Every rank stops together: one rank's NaN must not leave the others waiting in a collective."""
        if self.accelerator.num_processes == 1:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=self.accelerator.device)
        return float(self.accelerator.reduce(flag, reduction="sum")) == 0.0

    def message(self, args: TrainingArguments) -> str:
        """What happened, what is kept, and what to change."""
        step, what = self.bad
        last = (f"the last good step, {self.last_finite[0]}, had loss {self.last_finite[1]:.4g}" if self.last_finite
                else "no step was finite")
        out = Path(args.output_dir)
        checkpoint = get_last_checkpoint(str(out)) if out.is_dir() else None
        kept = (f"The last good checkpoint is {checkpoint}; resume from it with --resume_from_checkpoint {checkpoint}"
                " once the recipe is fixed." if checkpoint else
                "No checkpoint had been saved before it, and the diverged weights were not saved.")
        fp16 = ", or use bf16 instead of fp16" if args.fp16 else ""
        return (f"Training diverged at step {step}: {what}; {last}. Lower learning_rate (now {args.learning_rate:g}), "
                f"add warmup_steps or keep max_grad_norm > 0 (now {args.max_grad_norm:g}){fp16}. " + kept)
