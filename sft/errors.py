"""The one exception type users see: a problem in their recipe or data, reported without a traceback."""


class SFTError(Exception):
    """A config or data error: what is wrong, where, and how to fix it. The CLI exits 2 on it."""

    exit_code = 2
    every_rank = False  # raised by every rank of a launch at the same point, so they can still leave together


class TrainingInterrupted(SFTError):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint (the ranks agree on the step)."""

    every_rank = True

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(SFTError):
    """The loss or gradient norm stopped being finite; the run failed, though the recipe parsed (the ranks agree on
    the step)."""

    exit_code = 1
    every_rank = True
