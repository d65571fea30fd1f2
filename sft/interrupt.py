"""Clean interruption: SIGINT/SIGTERM stop training at the next step boundary with a checkpoint."""

import logging
import signal
from types import FrameType

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)


class StopOnSignal(TrainerCallback):
    """Turns the first SIGINT/SIGTERM into 'save and stop after this step'; a second one aborts at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
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

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt  # second signal: the user really wants out now
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, saving a checkpoint, then stopping "
                    "(send it again to abort without saving).", self.signal_name)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> TrainerControl:
        if self.signal_name is not None:
            control.should_save = True
            control.should_training_stop = True
        return control

    @property
    def exit_code(self) -> int:
        """128 + signal number, the shell convention for a process stopped by a signal."""
        return 128 + signal.Signals[self.signal_name or "SIGINT"].value
