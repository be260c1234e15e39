"""Render a results file's tables from its JSON, headed by the CPU and the date it was measured.

The documentation shows results through this module (its MkDocs hook, `docs/hooks/results.py`,
replaces `<!-- results: NAME -->` with `render(NAME)`), so a table on a page cannot drift from
its file: each kind of result is rendered by the function that wrote its Markdown report in the
first place (`specrt bench`, `--concurrency`, or the benchmark script named by its kind). A file
that names no machine or date is refused: a figure holds for the CPU kind it came from.

    python benchmarks/render_results.py cpu-vs-llamacpp [more names]   # print the rendering
    python benchmarks/render_results.py --index                           # every file, by CPU
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# kind -> the module whose `markdown(result)` writes that kind's report
RENDERERS = {
    "bench": "specrt.tools.report",
    "concurrency": "specrt.tools.concurrency",
    "attention_kernels": "attention_kernels",
    "big_target": "big_target",
    "batch_reads": "batch_reads",
    "call_spells": "call_spells",
    "price_error": "price_error",
    "calibration_error": "calibration_error",
    "draft_window": "draft_window",
    "ceilings": "ceilings",
    "gguf_forms": "gguf_forms",
    "kv_cache_types": "kv_cache_types",
    "grammar_engines": "grammar_engines",
    "long_context": "long_context",
    "prefill_chunks": "prefill_chunks",
    "prompt_cache": "prompt_cache",
    "quant_quality": "quant_quality",
    "row_padding": "row_padding",
    "structured": "structured",
}


class RenderError(ValueError):
    """A results file the docs cannot show: missing, of an unknown kind, or of no machine."""


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise RenderError(f"no results file {path}")
    return json.loads(path.read_text())


def renderer(kind: str | None) -> Callable[[dict], str]:
    if kind not in RENDERERS:
        raise RenderError(f"results of kind {kind!r} have no renderer; known: {sorted(RENDERERS)}")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the benchmark scripts beside this one
    return importlib.import_module(RENDERERS[kind]).markdown


def cpu_and_date(result: dict, name: str) -> tuple[str, str]:
    """The machine's one-line label (CPU model, SIMD features, cores, onnxruntime) and the date."""
    from specrt import machine

    recorded = result.get("machine") or {}
    if "cpu" not in recorded or "date" not in recorded:
        raise RenderError(f"{name}.json records no machine and date: its figures name no CPU")
    return machine.label(recorded), recorded["date"]


def render(name: str) -> str:
    """The file's report, its headings moved under the page's, after a line naming its CPU."""
    result = load(name)
    cpu, date = cpu_and_date(result, name)
    body = renderer(result.get("kind"))(result)
    body = re.sub(r"^(#+) ", lambda m: "#" * min(len(m[1]) + 2, 6) + " ", body, flags=re.M)
    head = f"**Measured on {cpu}, {date}** (`benchmarks/results/{name}.json`)"
    return f"{head}\n\n{body.strip()}\n"


def renderable() -> list[str]:
    """Every results file the docs can show, by name."""
    names = []
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("kind") in RENDERERS and {"cpu", "date"} <= set(result.get("machine", {})):
            names.append(path.stem)
    return names


def index() -> str:
    """A table of every renderable results file, grouped by the CPU kind it was measured on."""
    rows = []
    for name in renderable():
        result = load(name)
        cpu, date = cpu_and_date(result, name)
        rows.append((cpu, date, name, result["kind"]))
    lines = ["| CPU | date | results file | kind |", "|---|---|---|---|"]
    for cpu, date, name, kind in sorted(rows):
        lines.append(f"| {cpu} | {date} | `{name}` | {kind} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("names", nargs=-1)
@click.option("--index", "show_index", is_flag=True, help="Every results file, by CPU kind.")
def main(names: tuple[str, ...], show_index: bool) -> None:
    if show_index:
        click.echo(index())
    for name in names:
        click.echo(render(name))


if __name__ == "__main__":
    main()
