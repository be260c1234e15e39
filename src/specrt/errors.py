"""The one exception type users see: a message that names the problem, never a bare traceback."""


class SpecrtError(Exception):
    """A problem with the user's input, files or environment, worded for the user."""


class BundleError(SpecrtError):
    """A bundle that is missing, incomplete, tampered with, or inconsistent."""
