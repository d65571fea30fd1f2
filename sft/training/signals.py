"""Clean interruption: SIGINT/SIGTERM stop training at the next step boundary with a checkpoint, on every rank.

A signal often reaches one process only (a preempted node, `kill` of one rank) or reaches ranks in different steps.
Each rank only records what it received; at every step end all ranks agree (one tiny all-gather), so they stop after
the same step and enter the collective checkpoint save together instead of hanging in mismatched collectives.
"""

import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType

import torch
from accelerate import Accelerator
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

log = logging.getLogger(__name__)


class StopOnSignal(TrainerCallback):
    """Turns the first SIGINT/SIGTERM seen by any rank into 'save and stop after this step' on all ranks; a second
    one aborts the receiving process at once."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.received: int = 0  # signal number this process caught (0: none); set from the handler
        self.signal_name: str | None = None  # the signal all ranks agreed to stop on
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Catch SIGINT and SIGTERM (main thread only; elsewhere Python cannot install handlers)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                return

    def uninstall(self) -> None:
        """Restore the handlers that were there before training."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers for the duration of the block (training)."""
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            raise KeyboardInterrupt  # second signal: the user really wants out now
        self.received = signum
        log.warning("%s received: finishing this step, saving a checkpoint, then stopping "
                    "(send it again to abort without saving).", signal.Signals(signum).name)

    def agree(self) -> bool:
        """Whether any rank has received a signal; a collective, so every rank must call it at the same point."""
        if self.signal_name is None:
            if self.accelerator.num_processes == 1:
                agreed = self.received  # nothing to agree with: no device tensor, no sync on every step
            else:
                # The handler may fire during the gather: only the gathered value decides, identically on every rank.
                seen = self.accelerator.gather(torch.tensor([self.received], device=self.accelerator.device))
                agreed = int(seen.max())
            if agreed:
                self.signal_name = signal.Signals(agreed).name
                if not self.received:
                    log.warning("%s received by another process: stopping after this step with a checkpoint.",
                                self.signal_name)
        return self.signal_name is not None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> TrainerControl:
        if self.agree():
            control.should_save = True
            control.should_training_stop = True
        return control

    @property
    def exit_code(self) -> int:
        """128 + signal number, the shell convention for a process stopped by a signal."""
        return 128 + signal.Signals[self.signal_name or "SIGINT"].value
