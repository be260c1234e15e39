"""`specrt demo`: pull, build (once, cached) and run a pair with and without speculation.

The built-in default pair is configs/demo.yaml; `--tiny` builds tiny random models offline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specrt.files import specrt_home

if TYPE_CHECKING:
    from specrt.exporter.tensorrt import TrtOptions

Log = Callable[[str], None]


def demo_config() -> dict:
    from importlib import resources

    import yaml

    return yaml.safe_load(resources.files("specrt.configs").joinpath("demo.yaml").read_text())


def _cached_bundle(path: Path, log: Log) -> bool:
    from specrt.bundle import Bundle
    from specrt.errors import BundleError

    if not path.exists():
        return False
    try:
        Bundle.load(path)
    except BundleError as err:  # one built by an older specrt, or damaged
        log(f"rebuilding {path}: {err}")
        return False
    log(f"reusing cached bundle {path}")
    return True


def tiny_bundle(log: Log, tensorrt: TrtOptions | None = None, gpu=None) -> Path:
    """The tiny llama pair's bundle, built once; tensorrt (TrtOptions) builds a variant with
    TensorRT engines beside it, gpu (GpuGraph) one with GPU graphs, for the GPU check."""
    home = specrt_home() / "tiny"
    variant = "-tensorrt" if tensorrt is not None else "-gpu" if gpu is not None else ""
    bundle = home / f"bundle{variant}"
    if not _cached_bundle(bundle, log):
        from specrt.exporter.build import build_bundle
        from specrt.exporter.tiny import make_tiny_pair

        log(f"building a tiny llama pair under {home}")
        draft, target = make_tiny_pair(home / "models", "llama")
        build_bundle(
            str(draft),
            str(target),
            bundle,
            max_context=512,
            force=True,
            tensorrt=tensorrt,
            gpu=gpu,
            log=log,
        )
    return bundle


def default_bundle_path(config: dict | None = None) -> Path:
    """Where the built-in default pair's bundle is (or will be) built."""
    config = config or demo_config()
    target, precision = config["target"], config.get("target_precision", "fp32")
    target += "" if precision == "fp32" else f"-{precision}"
    name = f"{config['draft']}-{config.get('draft_precision', 'fp32')}__{target}"
    return specrt_home() / "bundles" / name


def real_bundle(config: dict, log: Log) -> Path:
    from specrt.models import lookup, pull

    paths = {role: pull(lookup(config[role]), log=log) for role in ("draft", "target")}
    weights = {role: config.get(f"{role}_precision", "fp32") for role in ("draft", "target")}
    bundle = default_bundle_path(config)
    if not _cached_bundle(bundle, log):
        from specrt.exporter.build import build_bundle
        from specrt.exporter.precision import Precision

        build_bundle(
            str(paths["draft"]),
            str(paths["target"]),
            bundle,
            max_draft=config["max_draft"],
            max_context=config.get("max_context"),  # default: the models' own
            precision={role: Precision(w) for role, w in weights.items()},
            force=True,
            log=log,
        )
    return bundle


def run_comparison(
    bundle: Path, prompt: str, max_new_tokens: int, *, chat: bool = False, log: Log
) -> None:
    from specrt.runtime import SpeculativeRuntime

    # each run pays its prefill
    runtime = SpeculativeRuntime.load(bundle, prompt_cache=False, calibrate=False)
    request = [{"role": "user", "content": prompt}] if chat else prompt
    runtime.calibrate(longest=len(runtime.encode(request)) + max_new_tokens)
    log(f"prompt: {prompt!r}")
    runtime.generate(request, max_new_tokens=4)  # warm-up: first runs allocate
    alone = runtime.generate(request, max_new_tokens=max_new_tokens, speculate=False)
    spec = runtime.generate(request, max_new_tokens=max_new_tokens)
    for label, result in (("target alone", alone), ("speculative", spec)):
        click.echo(f"--- {label}: {result.stats.tokens_per_second:.1f} tok/s")
        click.echo(result.text)
    same = "identical" if alone.token_ids == spec.token_ids else "DIFFERENT (a bug: report it)"
    speedup = spec.stats.tokens_per_second / max(alone.stats.tokens_per_second, 1e-9)
    click.echo(
        f"--- outputs {same}; acceptance {spec.stats.acceptance_rate:.0%}, "
        f"{spec.stats.tokens_per_target_call:.2f} tokens per target call, "
        f"speedup {speedup:.2f}x"
    )
