"""`specrt serve`: the OpenAI-compatible server, here or on Ray Serve."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import log as _log
from specrt.engines import BACKENDS
from specrt.errors import SpecrtError
from specrt.runtime.drafters import DRAFT_WINDOW, DRAFTERS
from specrt.runtime.scheduler import PREFILL_CHUNK


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True)
@click.option(
    "--max-batch", default=8, show_default=True, help="Requests advanced together (slots)."
)
@click.option("--max-queue", default=32, show_default=True, help="Waiting requests; then 429.")
@click.option(
    "--timeout",
    default=600.0,
    show_default=True,
    help="Seconds per request, queue included (0 = none).",
)
@click.option(
    "--controller",
    default="adaptive",
    show_default=True,
    help="Default speculation: off | fixed:K | heuristic | adaptive.",
)
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    default=None,
    help="Default drafter [default: model, or ngram for a bundle without a draft model].",
)
@click.option(
    "--api-key", envvar="SPECRT_API_KEY", default=None, help="Require 'Authorization: Bearer KEY'."
)
@click.option(
    "--model-name", default=None, help="The model id clients send [default: bundle name]."
)
@click.option("--backend", default="onnxruntime", show_default=True, type=click.Choice(BACKENDS))
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option(
    "--prompt-cache/--no-prompt-cache",
    default=True,
    show_default=True,
    help="Start a prompt from what a slot already holds of it (exact; off: every prompt "
    "computed whole, as when measuring prefill).",
)
@click.option(
    "--prefill-chunk",
    default=PREFILL_CHUNK,
    show_default=True,
    help="Prompt tokens fed between rounds, so a long prompt joining stalls the running "
    "requests one chunk at most (0: each prompt whole).",
)
@click.option(
    "--draft-window",
    default=DRAFT_WINDOW,
    show_default=True,
    help="The most prompt tokens the draft model reads: the prompt's first 4 and its last "
    "ones, so drafting after a long prompt costs what it costs after a short one (0: the "
    "whole prompt). Outputs do not change: the target verifies every draft.",
)
@click.option(
    "--kv-budget",
    default=None,
    help="Cache positions the slots may hold at once, shared (65536), or a size (12GB): a "
    "request waits until its prompt and max_tokens fit [default: what 80% of the memory "
    "available at load holds, where every slot's full context would not fit].",
)
@click.option(
    "--prefix-cache",
    default=None,
    help="Host memory that keeps prompt prefixes beyond the slots (8GB; 0: none), so a "
    "conversation, document or system prompt that comes back after the slots were reused is "
    "not computed again [default: a quarter of the memory available at start-up, 8 GiB at "
    "most].",
)
@click.option(
    "--chat-template",
    type=click.Path(path_type=Path),
    help="A Jinja chat template used in place of the bundle's (for a bundle without one, or "
    "to fix one).",
)
@click.option(
    "--tool-parser",
    type=click.Choice(["auto", "hermes", "mistral", "phi4_mini_json", "pythonic", "llama3_json"]),
    default="auto",
    show_default=True,
    help="The format tool calls are parsed and enforced in (auto: the one the chat template "
    "writes).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(["auto", "think", "none"]),
    default="auto",
    show_default=True,
    help="Return a <think>...</think> thought as reasoning_content, apart from the answer "
    "(auto: where the chat template writes the tags).",
)
@click.option(
    "--max-body-size",
    default="16MB",
    show_default=True,
    help="A larger request body gets a 413 before it is read.",
)
@click.option(
    "--drain-timeout",
    default=25.0,
    show_default=True,
    help="Seconds from SIGTERM or Ctrl-C to exit: new requests get a 503 and /health says "
    "draining; what still runs then ends with a last chunk that says so. A second signal "
    "ends at once.",
)
@click.option("--log-level", default="info", show_default=True)
@click.option("--ray", "on_ray", is_flag=True, help="Serve on Ray Serve (the ray extra).")
@click.option("--replicas", type=int, default=1, show_default=True, help="--ray: engine replicas.")
@click.option("--min-replicas", type=int, help="--ray: autoscale between this many...")
@click.option("--max-replicas", type=int, help="...and this many, on ongoing requests.")
@click.option("--ray-address", help="--ray: join this cluster (auto, ray://...) [default: local].")
def serve(on_ray, replicas, min_replicas, max_replicas, ray_address, log_level, **options):
    """Serve BUNDLE over an OpenAI-compatible HTTP API (needs the serve extra); with --ray, as
    engine replicas on Ray Serve behind the same API (docs/ray.md)."""
    try:
        from specrt.serve.launch import serve as start
        from specrt.serve.settings import RayOptions, ServeSettings
    except ImportError as err:
        raise SpecrtError(
            f"specrt serve needs the serve extra: pip install 'specrt[serve]' ({err})"
        ) from err
    options["timeout"] = options["timeout"] or None  # 0: none
    options["api_key"] = options["api_key"] or None
    settings = ServeSettings(**options)
    ray = RayOptions(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas)
    if not on_ray and (ray != RayOptions() or ray_address):
        raise SpecrtError("--replicas, --min-replicas, --max-replicas and --ray-address need --ray")
    start(settings, ray=ray if on_ray else None, address=ray_address, log_level=log_level, say=_log)
