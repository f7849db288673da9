"""The one error type for unusable input data: its message names the file and row (or the split)."""

from __future__ import annotations


class DataError(Exception):
    """A data row or file that cannot be used; the message names file and line (or row).

    `quiet`: raised on a rank whose own data was fine because another rank's was not (that rank prints the
    reason), so a launcher exits non-zero without printing a second, less useful line.
    """

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet
