"""The one exception type users see: a message that names the problem, never a bare traceback.

Each error has a `kind`, what sort of failure it is, and nothing else says how to answer it:
the server's one table (`specrt.serve.errors`) maps a kind to its HTTP status, so the runtime
and the worker raise kinds and never mint statuses.
"""

from __future__ import annotations


class SpecrtError(Exception):
    """A problem with the user's input, files or environment, worded for the user.

    `param` names the argument at fault (as the Python API spells it) and `code` says what kind
    of problem it is, so a server can answer with a structured error instead of parsing text.
    """

    kind = "invalid"  # the request's values or the user's files are at fault

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class BundleError(SpecrtError):
    """A bundle that is missing, incomplete, tampered with, or inconsistent."""


class Busy(SpecrtError):
    """Too many requests are already waiting; `retry_after` seconds is a fair wait."""

    kind = "busy"
    retry_after: int | None = None


class Unavailable(SpecrtError):
    """Nothing can serve the request now (loading, failed, shutting down)."""

    kind = "unavailable"
    retry_after: int | None = None


class TimedOut(SpecrtError):
    """The request's deadline passed before it could start."""

    kind = "timeout"


class EngineFailure(SpecrtError):
    """An engine call failed: the server's fault, not the request's."""

    kind = "engine"
