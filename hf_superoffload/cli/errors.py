"""The command line's one error type: bad input, reported as a message and exit code 2."""

from __future__ import annotations

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(ValueError):
    """Input the command cannot act on; the message says what to change."""
