"""What the command modules share."""

from __future__ import annotations

import click


def log(message: str) -> None:
    """Progress for the user, on stderr (stdout stays the command's result)."""
    click.echo(message, err=True)
