"""`specrt demo` and `specrt doctor`: the built-in default pair, and what this machine runs."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import log as _log


@click.command()
@click.option(
    "--tiny",
    is_flag=True,
    help="Tiny random models built offline, instead of the built-in real pair (configs/demo.yaml).",
)
@click.option("--max-new-tokens", type=int, default=None, help="Default: the demo config's.")
@click.option(
    "--float32-target", is_flag=True, help="Build the target as float32 instead of its GGUF blocks."
)
def demo(tiny: bool, max_new_tokens: int | None, float32_target: bool):
    """Pull, build (once, cached) and run a draft/target pair, with and without speculation."""
    from specrt.tools.demo import demo_config, real_bundle, run_comparison, tiny_bundle

    config = demo_config() | ({"target_precision": "fp32"} if float32_target else {})
    bundle = tiny_bundle(_log) if tiny else real_bundle(config, _log)
    prompt = "def fibonacci(n):" if tiny else config["prompt"]
    chat = not tiny and config.get("chat", False)
    run_comparison(bundle, prompt, max_new_tokens or config["max_new_tokens"], chat=chat, log=_log)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the facts and verdicts as JSON.")
@click.option(
    "--gpu-check",
    "gpu_json",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Run every GPU backend on the tiny and default bundles; write the table as JSON here.",
)
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path))
def doctor(as_json: bool, gpu_json: Path | None, bundles: tuple[Path, ...]):
    """Which backends this machine can run, and why not where it cannot; its CPU; whether each
    --bundle's target pads calls to even rows here; with --gpu-check, whether each GPU backend
    is exact and how fast on the bundles (see docs/gpu.md)."""
    from specrt.tools.doctor import render

    if gpu_json is not None:
        from specrt.tools.gpucheck import report

        raise SystemExit(0 if report(gpu_json, list(bundles), _log, click.echo) else 1)
    click.echo(render(as_json, bundles))
