"""The one exception type users see: a problem in their recipe or data, reported without a traceback."""


class SFTError(Exception):
    """A config or data error: what is wrong, where, and how to fix it. The CLI exits 2 on it."""

    exit_code = 2
