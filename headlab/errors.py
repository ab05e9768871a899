"""The errors a user can cause and act on.

Every loader, reader, writer and validator raises one of these with a message that
names the file or value, says what was expected and what to do. The CLI turns exactly
these into one line on stderr and exit code 2; anything else is a bug and keeps its
traceback. They subclass ValueError, so code that catches bad input that way still does.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user: one line saying what was wrong and what to do."""


class DataError(UserError):
    """The data cannot be used; the message says what was wrong and what to do."""


class ModelNotFoundError(UserError):
    """The name resolves to nothing loadable; the message says what to do."""


class CaptureTooLargeError(UserError, MemoryError):
    """A capture would store more than the limit; the message lists the ways out.

    ``needed`` and ``limit`` hold the estimate and the limit, in bytes.
    """

    def __init__(self, message: str, *, needed: int | None = None,
                 limit: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.limit = limit


class CorruptFileError(UserError):
    """A file is truncated or its contents contradict its own header; ``path`` names it."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class RunLockedError(UserError):
    """Another live process holds the run directory; ``pid`` is that process."""

    def __init__(self, message: str, *, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
