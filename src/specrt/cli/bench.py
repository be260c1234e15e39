"""`specrt bench` (and its `--concurrency` load form), `specrt replay` and `specrt verdict`:
measure, and judge what was measured."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import log as _log
from specrt.errors import SpecrtError


@click.command("replay")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--prompts",
    "prompt_files",
    multiple=True,
    type=click.Path(path_type=Path),
    help="JSONL prompt set (repeatable). Default: benchmarks/prompts/*.jsonl.",
)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--clients", default="1,2,4,8", show_default=True, help="Comma-separated counts.")
@click.option(
    "--traces",
    type=click.Path(path_type=Path),
    help="Read the recorded acceptance from this file if it exists, else record it there.",
)
def replay_command(bundle: Path, prompt_files, max_new_tokens: int, clients: str, traces):
    """Replay fixed K and adaptive on this pair's recorded acceptance, priced with this
    machine's calibrated costs: tokens/s per controller and client count, free of the clock's
    noise (decoding only). For tuning a controller; the benchmarks measure the real thing."""
    from specrt.runtime import SpeculativeRuntime
    from specrt.tools import replay
    from specrt.tools.prompts import load_prompts, prompt_input

    levels = [int(n) for n in clients.split(",")]
    _log(f"loading {bundle} with {max(levels)} slots (and calibrating its cost curves)")
    rt = SpeculativeRuntime.load(bundle, slots=max(levels), prompt_cache=False)
    if traces is not None and traces.exists():
        recorded = replay.load(traces)
    else:
        prompts = load_prompts(_prompt_files(prompt_files))
        _log(f"recording acceptance on {len(prompts)} prompts")
        recorded = replay.record(rt, [prompt_input(p) for p in prompts], max_new_tokens)
        if traces is not None:
            replay.save(recorded, traces)
    click.echo(replay.report(recorded, levels, rt.costs, rt.bundle.max_draft))


@click.command("verdict")
@click.argument(
    "results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--apart",
    is_flag=True,
    help="Judge each file's cells apart (default: a cell in several files, the same code run "
    "again, is judged on all their turns).",
)
def verdict_command(results, apart: bool):
    """Whether adaptive holds 0.97x the best other configuration in each cell of these result
    files (`specrt bench --concurrency`, benchmarks/long_context.py --speculation --runs),
    judged on the turns' spread: holds, misses, or within noise, and how many turns would
    tell; then all the cells' turns together. A cell's ratio alone moves more than 3 % between
    runs of the same code here."""
    from specrt.tools import verdict

    click.echo(verdict.report(list(results), pool=not apart), nl=False)


def _prompt_files(given) -> list[Path]:
    files = list(given) or sorted(Path("benchmarks/prompts").glob("*.jsonl"))
    if not files:
        raise SpecrtError("no prompt files: pass --prompts FILE.jsonl")
    return files


@click.command()
@click.argument("bundles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--prompts",
    "prompt_files",
    multiple=True,
    type=click.Path(path_type=Path),
    help="JSONL prompt set (repeatable), Spec-Bench's question.jsonl too. "
    "Default: benchmarks/prompts/*.jsonl.",
)
@click.option("--categories", default=None, help="Comma-separated prompt categories to run.")
@click.option("--per-category", type=int, default=None, help="At most N prompts per category.")
@click.option(
    "--stop-at-eos",
    is_flag=True,
    help="Stop each answer where the model ends it (Spec-Bench's way) instead of generating "
    "exactly --max-new-tokens.",
)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option(
    "--concurrency",
    default=None,
    help="Comma-separated client counts (e.g. 1,2,4,8,16): run the load benchmark instead.",
)
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    help="Runs per prompt (with --concurrency: per level).",
)
@click.option("--only", default=None, help="Comma-separated configuration names to run.")
@click.option("--threads", type=int, default=None, help="Threads for every engine.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True
)
@click.option("--name", default=None, help="File stem for the results (default: bundle name).")
@click.option(
    "--genai-model",
    "genai_models",
    multiple=True,
    help="[LABEL=]DIR: an ONNX Runtime GenAI build of the same target; adds the row ort_genai "
    "(or ort_genai_LABEL, e.g. int4=DIR). Repeatable.",
)
@click.option("--llama-cpp", help="llama-server (or its folder): adds llama.cpp's rows.")
@click.option(
    "--llama-cpp-drafts",
    default=None,
    help="Comma-separated draft lengths for llama.cpp's draft rows (default: the bundle's K_max).",
)
def bench(
    bundles,
    prompt_files,
    categories,
    per_category,
    stop_at_eos,
    max_new_tokens,
    concurrency,
    repeat,
    only,
    threads,
    out,
    name,
    genai_models,
    llama_cpp,
    llama_cpp_drafts,
):
    """Benchmark every configuration side by side: JSON, Markdown table and PNG chart.

    Several BUNDLES (e.g. one per precision combination) share one run: the baselines run once,
    and each non-float32 bundle's rows carry its precision label.
    """
    from specrt.tools.bench import run_bench
    from specrt.tools.report import markdown, write_report

    genai = {label: Path(folder) for label, _, folder in (m.rpartition("=") for m in genai_models)}
    prompts = _prompts(prompt_files, categories, per_category)
    stem = name or Path(bundles[0]).resolve().name
    drafts = tuple(int(n) for n in llama_cpp_drafts.split(",")) if llama_cpp_drafts else None
    if concurrency:
        from specrt.tools.concurrency import bench_concurrency

        selected = only.split(",") if only else None
        report = bench_concurrency(
            bundles,
            prompts,
            concurrency,
            max_new_tokens,
            repeat,
            selected,
            threads,
            out,
            stem,
            _log,
            llama_cpp,
            drafts,
        )
        click.echo(report)
        return
    result = run_bench(
        bundles,
        prompts,
        max_new_tokens=max_new_tokens,
        repeat=repeat,
        only=only.split(",") if only else None,
        threads=threads,
        genai_models=genai,
        stop_at_eos=stop_at_eos,
        llama_cpp=llama_cpp,
        llama_drafts=drafts,
        log=_log,
    )
    for path in write_report(result, out, stem, log=_log):
        _log(f"wrote {path}")
    click.echo(markdown(result))


def _prompts(prompt_files, categories, per_category) -> list[dict]:
    from specrt.tools.prompts import load_prompts

    files = _prompt_files(prompt_files)
    prompts = load_prompts(files, categories.split(",") if categories else None, per_category)
    if not prompts:
        raise SpecrtError("no prompts left: check --categories against the prompt files")
    return prompts
