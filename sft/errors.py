"""The one exception type users see: a problem in their recipe or data, reported without a traceback."""


class SFTError(Exception):
    """A config or data error: what is wrong, where, and how to fix it. The CLI exits 2 on it."""

    exit_code = 2


class TrainingInterrupted(SFTError):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(SFTError):
    """The loss or gradient norm stopped being finite; the run failed, though the recipe parsed."""

    exit_code = 1
