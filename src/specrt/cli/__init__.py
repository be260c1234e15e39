"""The `specrt` command line: build, inspect, eval, generate, demo, bench, serve, models.

Every user-facing failure is a SpecrtError; the group turns it into one clear line and exit
status 1 instead of a traceback. Heavy imports happen inside the commands that need them; each
command group has its module here.
"""

from __future__ import annotations

import click

from specrt.cli import bench, build, generate, serve, tools
from specrt.cli.models import models
from specrt.errors import SpecrtError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecrtError as err:
            raise click.ClickException(str(err)) from err


@click.group(cls=_Group)
@click.version_option(package_name="specrt")
def cli() -> None:
    """Speculative decoding: export a draft + target pair, then generate losslessly faster."""


for _command in (
    build.build,
    build.inspect,
    build.eval_command,
    generate.generate,
    tools.demo,
    bench.replay_command,
    bench.bench,
    bench.verdict_command,
    serve.serve,
    tools.doctor,
    models,
):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="specrt")
