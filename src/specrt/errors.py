"""The one exception type users see: a message that names the problem, never a bare traceback."""

from __future__ import annotations


class SpecrtError(Exception):
    """A problem with the user's input, files or environment, worded for the user.

    `param` names the argument at fault (as the Python API spells it) and `code` says what kind
    of problem it is, so a server can answer with a structured error instead of parsing text.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class BundleError(SpecrtError):
    """A bundle that is missing, incomplete, tampered with, or inconsistent."""
