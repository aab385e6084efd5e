"""The one error type a user of minillm sees.

Anything the user can cause (unknown model, missing weights, a truncated file, a bad flag) raises
`MiniLLMError` with a one-line message; the CLI prints that line and exits 1, never a traceback.
"""


class MiniLLMError(Exception):
    """A user-facing error: its message is one line that says what is wrong and, if known, the fix."""


class WeightsNotFound(MiniLLMError):
    """A preset's weights are not on disk; the message names the command that fetches them."""


class InvalidValue(MiniLLMError, ValueError):
    """An argument outside what it may be (a NaN temperature, a negative seed, an empty prompt).

    Also a ValueError, so code that already catches ValueError from these checks keeps working.
    `param` names the argument when the caller knows it (the server's 400 then names that field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
