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


def device_values(*values: torch.Tensor | float) -> torch.Tensor:
    """The scalars stacked into one float32 tensor on the device of the first tensor among them (the host where
    none is a tensor)."""
    # FSDP2's gradient norm is a DTensor (clip_grad_norm_ over sharded gradients), which refuses .tolist(): read its
    # full value (replicated: no communication) like any tensor.
    values = tuple(v.full_tensor() if isinstance(v, DTensor) else v for v in values)
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    # torch.full, not torch.tensor: a host-to-device copy of a Python number would wait for the device too.
    return torch.stack([v.detach().float().reshape(()).to(device) if isinstance(v, torch.Tensor)
                        else torch.full((), float(v), device=device) for v in values])


class StepValues:
    """One optimizer step's loss, gradient norm and count of ranks where either is not finite, on the device; with
    `deferred`, also being copied to the host without waiting (read_later reads that copy once it has landed)."""

    def __init__(self, step: int, loss: torch.Tensor | float, norm: torch.Tensor | float, accelerator: Accelerator,
                 deferred: bool) -> None:
        self.step = step
        values = device_values(loss, norm)
        bad = (~torch.isfinite(values)).any().float().reshape(1)
        if accelerator.num_processes > 1:  # every rank stops together: one rank's NaN must not strand the others
            bad = accelerator.reduce(bad.to(accelerator.device), reduction="sum").to(values.device)
        self.values = torch.cat([values, bad])
        self.copy, self.landed = None, None
        if deferred:
            self.copy = self.values.to("cpu", non_blocking=True, copy=True)  # (copy: a new tensor on CPU too)
            if self.values.is_cuda:
                self.landed = torch.cuda.Event()
                self.landed.record()

    def read_now(self) -> tuple[float, float, bool]:
        """(loss, norm, every rank finite), waiting for the device to finish the step."""
        return self._unpack(self.values.tolist())

    def read_later(self) -> tuple[float, float, bool]:
        """The same from the host copy: a step later the device has long finished it, so the wait is none."""
        if self.landed is not None:
            self.landed.synchronize()
        return self._unpack(self.copy.tolist())

    @staticmethod
    def _unpack(values: list[float]) -> tuple[float, float, bool]:
        loss, norm, bad = values
        return loss, norm, bad == 0


class DivergenceGuard(TrainerCallback):
    """Stops at the first optimizer step whose loss or gradient norm is not finite.

    On a CUDA GPU (`deferred`) a step's values are read at the end of the next step, from a copy the GPU made without
    the host waiting: reading them at once would make the host wait for the GPU at every optimizer step, the GPU then
    idle while the host fetches and collates the next batch (about 8 ms a step on 2 CPU cores, 8 x 2048 tokens). A
    diverged step then stops training a step later, named as itself; a step that saves, evaluates or ends training is
    read at once, so no diverged weights are saved and the last checkpoint stays the last good one.
    """

    def __init__(self, accelerator: Accelerator, deferred: bool | None = None) -> None:
        self.accelerator = accelerator
        self.deferred = accelerator.device.type == "cuda" if deferred is None else deferred
        self._step_loss = 0.0
        self._grad_norm = 0.0
        self._pending: StepValues | None = None  # the last step's values, not yet read
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the last good step
        self.bad: tuple[int, str] | None = None  # (step, what was not finite)

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (already scaled for gradient accumulation); the step's loss is their sum.

        The sum stays on the loss's device: reading it here would make the host wait for the GPU on every
        micro-step. on_step_end reads it, with the gradient norm, once per optimizer step (or a step later).
        """
        self._step_loss = self._step_loss + loss.detach()

    def add_grad_norm(self, norm: torch.Tensor | float | None, fp16: bool) -> None:
        """The step's gradient norm as the Trainer computed it (SFTMixin._get_grad_norm): before clipping, through
        accelerate, so FSDP and ZeRO norms count too. fp16's loss scaler skips steps with infinite gradients on
        purpose; that is not divergence."""
        if norm is not None and not fp16:
            self._grad_norm = norm  # a device tensor: read at the step's end or a step later

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        """Judge the step before (deferred), and this step too where it must be known now: not deferred, or the
        step saves, evaluates or ends training (the decision to stop, and not to save, needs its values)."""
        current = StepValues(state.global_step, self._step_loss, self._grad_norm, self.accelerator, self.deferred)
        self._step_loss, self._grad_norm = 0.0, 0.0
        earlier, self._pending = self._pending, current
        if earlier is not None:
            self._judge(earlier.step, *earlier.read_later(), control)
        if not self.deferred or control.should_save or control.should_evaluate or control.should_training_stop:
            self._read_pending(control)
            if self.bad is None and control.should_save:  # belt and braces: never save weights that are not finite
                weights = all(bool(torch.isfinite(p).all()) for p in kwargs["model"].parameters())
                if not self._agree(weights):
                    self._stop(state.global_step, "the weights are not finite", control)
        return control

    def _read_pending(self, control: TrainerControl) -> None:
        """Judge the step whose values are still unread, now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._judge(pending.step, *pending.read_now(), control)

    def _judge(self, step: int, loss: float, norm: float, finite: bool, control: TrainerControl) -> None:
        if not finite:
            what = (f"the loss is {loss}" if not math.isfinite(loss)
                    else f"the gradient norm is {norm} at loss {loss:.4g}" if not math.isfinite(norm)
                    else "the loss or gradient norm is not finite on another process")
            self._stop(step, what, control)
        elif self.bad is None:
            self.last_finite = (step, loss)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> TrainerControl:
        if control.should_save or control.should_evaluate:
            self._read_pending(control)
        if self.bad is not None:  # the epoch-end save/eval would write the diverged weights
            control.should_save = control.should_evaluate = False
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> TrainerControl:
        self._read_pending(control)  # a run whose last step was not judged yet (it ended otherwise than by its steps)
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
