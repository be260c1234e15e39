"""The `specrt` command line: build, inspect, eval, generate, demo, bench, serve, models.

Every user-facing failure is a SpecrtError; the group turns it into one clear line and exit
status 1 instead of a traceback. Heavy imports happen inside the commands that need them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.engines import BACKENDS
from specrt.errors import SpecrtError
from specrt.files import specrt_home
from specrt.models_cli import models
from specrt.runtime.drafters import DRAFTERS
from specrt.runtime.scheduler import PREFILL_CHUNK


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecrtError as err:
            raise click.ClickException(str(err)) from err


def _log(message: str) -> None:
    click.echo(message, err=True)


@click.group(cls=_Group)
@click.version_option(package_name="specrt")
def cli() -> None:
    """Speculative decoding: export a draft + target pair, then generate losslessly faster."""


@cli.command()
@click.option(
    "--draft",
    default=None,
    help="Draft model: HF folder, hub id or .gguf file. Without one, the bundle speculates by "
    "lookup (n-gram) alone.",
)
@click.option("--target", required=True, help="Target model: HF folder, hub id or .gguf file.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Bundle folder.")
@click.option("--max-draft", default=8, show_default=True, help="K_max: most drafts per round.")
@click.option("--max-lookup", default=32, show_default=True, help="Most free drafts per call.")
@click.option(
    "--max-context",
    type=int,
    default=None,
    help="KV cache positions [default: the smaller of 2048 and the models' own limit].",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option(
    "--draft-precision",
    default="fp32",
    show_default=True,
    help="fp32|fp16|int8|int4|gguf. Changes acceptance only: outputs stay exact.",
)
@click.option(
    "--target-precision",
    default="fp32",
    show_default=True,
    help="fp32|fp16|int8|int4|gguf (a GGUF file's own blocks). Outputs are exact against it.",
)
@click.option("--block-size", type=int, help="int8/int4 quantization block [default: 128].")
@click.option(
    "--accuracy-level",
    type=int,
    help="int8/int4 MatMulNBits compute: 4 = int8 activations, 0/1 = float32 [default: 4].",
)
@click.option(
    "--backend",
    type=click.Choice(["onnxruntime", "tensorrt"]),
    default="onnxruntime",
    show_default=True,
    help="tensorrt also compiles each graph into a TensorRT engine (TensorRT 10.1+, a GPU).",
)
@click.option(
    "--trt-precision",
    type=click.Choice(["fp16", "fp32"]),
    default="fp16",
    show_default=True,
    help="TensorRT engine precision: the graph is converted to it (fp32: exact, no TF32).",
)
@click.option("--workspace", default=4.0, show_default=True, help="TensorRT workspace, GiB.")
@click.option(
    "--timing-cache",
    type=click.Path(path_type=Path),
    default=None,
    help="TensorRT timing cache reused across builds [default: $SPECRT_HOME/tensorrt.cache].",
)
@click.option(
    "--version-compatible",
    is_flag=True,
    help="Build TensorRT engines that later TensorRT versions' lean runtime can load.",
)
def build(
    draft: str | None,
    target: str,
    out: Path,
    max_draft: int,
    max_lookup: int,
    max_context: int | None,
    force: bool,
    draft_precision: str,
    target_precision: str,
    block_size: int | None,
    accuracy_level: int | None,
    backend: str,
    trt_precision: str,
    workspace: float,
    timing_cache: Path | None,
    version_compatible: bool,
):
    """Export DRAFT and TARGET to an ONNX bundle, checked against PyTorch."""
    from specrt.exporter.build import build_bundle
    from specrt.exporter.precision import Precision
    from specrt.exporter.tensorrt import TrtOptions

    tensorrt = None
    if backend == "tensorrt":
        tensorrt = TrtOptions(
            trt_precision,
            workspace,
            timing_cache or specrt_home() / "tensorrt.cache",
            version_compatible,
        )

    options = {"block_size": block_size, "accuracy_level": accuracy_level}
    options = {key: value for key, value in options.items() if value is not None}
    precision = {
        role: Precision(weights, **options)
        for role, weights in (("draft", draft_precision), ("target", target_precision))
    }
    build_bundle(
        draft,
        target,
        out,
        max_draft=max_draft,
        max_lookup=max_lookup,
        max_context=max_context,
        force=force,
        precision=precision,
        tensorrt=tensorrt,
        log=_log,
    )
    click.echo(f"bundle written: {out}")


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(bundle: Path, as_json: bool):
    """Show a bundle's manifest and verify every file against its sha256."""
    from specrt.bundle import Bundle

    loaded = Bundle.load(bundle, full_check=True)
    m = loaded.manifest
    if as_json:
        click.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    from specrt.inspection import bundle_lines

    for line in bundle_lines(loaded):
        click.echo(line)


@cli.command("eval")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--reference",
    type=click.Path(path_type=Path),
    help="Compare with this bundle's roles [default: each role's source in float32, by PyTorch].",
)
@click.option(
    "--text",
    "texts",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Text file (repeatable) [default: json/decoder.py and the prose sample].",
)
@click.option("--tokens", default=512, show_default=True, help="Tokens scored per text.")
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write JSON here.")
def eval_command(
    bundle: Path,
    reference: Path | None,
    texts: tuple[Path, ...],
    tokens: int,
    threads: int | None,
    json_out: Path | None,
):
    """Perplexity, KL divergence and top-1 agreement of each role against a reference."""
    from specrt.bundle import Bundle
    from specrt.files import write_json_atomic
    from specrt.quality import DEFAULT_TEXTS, evaluate, quality_lines

    results = evaluate(
        Bundle.load(bundle),
        Bundle.load(reference) if reference else None,
        texts or DEFAULT_TEXTS,
        tokens=tokens,
        threads=threads,
    )
    for line in quality_lines(results):
        click.echo(line)
    if json_out:
        write_json_atomic(
            json_out,
            {"bundle": str(bundle), "reference": reference and str(reference), "roles": results},
        )


def _structure(json_schema: Path | None, grammar: Path | None, regex: str | None):
    from specrt.runtime.grammar import Structure, load_structure

    given = [g for g in (json_schema, grammar, regex) if g is not None]
    if len(given) > 1:
        raise click.UsageError("give one of --json-schema, --grammar, --regex")
    if regex is not None:
        return Structure("regex", regex)
    if given:
        return load_structure("json_schema" if json_schema else "lark", str(given[0]))
    return None


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message via the chat template.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", type=int, default=None, help="Make sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--controller", default="adaptive", show_default=True, help="fixed:K | heuristic | adaptive"
)
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    default=None,
    help="Who drafts: the draft model, a lookup in the context (ngram), or both (hybrid) "
    "[default: model, or ngram for a bundle without a draft model].",
)
@click.option("--no-speculation", is_flag=True, help="Run the target alone (same engine).")
@click.option(
    "--backend",
    default="onnxruntime",
    show_default=True,
    type=click.Choice(BACKENDS),
    help="onnxruntime (CPU), onnxruntime-cuda, onnxruntime-tensorrt, tensorrt or torch.",
)
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--stats", is_flag=True, help="Print speed and acceptance statistics.")
@click.option("--json", "as_json", is_flag=True, help="Print text, ids and stats as JSON.")
@click.option(
    "--prediction-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text the output should mostly repeat (OpenAI's Predicted Outputs): a free draft.",
)
@click.option("--show-accepted", is_flag=True, help="Colour text the drafts or prediction made.")
@click.option("--json-schema", type=click.Path(path_type=Path), help="Output matches this schema.")
@click.option("--grammar", type=click.Path(path_type=Path), help="... this Lark or GBNF grammar.")
@click.option("--regex", help="... this regular expression.")
def generate(
    bundle,
    prompt,
    chat,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop,
    controller,
    drafter,
    no_speculation,
    backend,
    threads,
    stream,
    stats,
    as_json,
    prediction_file,
    show_accepted,
    json_schema,
    grammar,
    regex,
):
    """Generate from PROMPT with speculative decoding (constrained by a JSON schema, a grammar
    or a regular expression where given: exactly the constrained target's output)."""
    from specrt.display import LEGEND, accepted_text, format_stats, json_result
    from specrt.runtime import SpeculativeRuntime

    runtime = SpeculativeRuntime.load(
        bundle, backend=backend, controller=controller, drafter=drafter, threads=threads
    )
    request = [{"role": "user", "content": prompt}] if chat else prompt
    generation = runtime.stream(
        request,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop,
        speculate=not no_speculation,
        prediction=prediction_file.read_text(encoding="utf-8") if prediction_file else None,
        structure=_structure(json_schema, grammar, regex),
    )
    for delta in generation:
        if stream and not as_json and not show_accepted:
            click.echo(delta, nl=False)
            sys.stdout.flush()
    result = generation.result
    if as_json:
        click.echo(json_result(result))
        return
    if show_accepted:
        click.echo(accepted_text(runtime.tokenizer, result))
        _log(LEGEND)
    else:
        click.echo("" if stream else result.text)
    if stats:
        _log(format_stats(result.stats, result.finish_reason))


@cli.command()
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
    from specrt.demo import demo_config, real_bundle, run_comparison, tiny_bundle

    config = demo_config() | ({"target_precision": "fp32"} if float32_target else {})
    bundle = tiny_bundle(_log) if tiny else real_bundle(config, _log)
    prompt = "def fibonacci(n):" if tiny else config["prompt"]
    chat = not tiny and config.get("chat", False)
    run_comparison(bundle, prompt, max_new_tokens or config["max_new_tokens"], chat=chat, log=_log)


@cli.command("replay")
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
    from specrt import replay
    from specrt.bench import load_prompts, prompt_input
    from specrt.runtime import SpeculativeRuntime

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


def _prompt_files(given) -> list[Path]:
    files = list(given) or sorted(Path("benchmarks/prompts").glob("*.jsonl"))
    if not files:
        raise SpecrtError("no prompt files: pass --prompts FILE.jsonl")
    return files


@cli.command()
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
    from specrt.bench import load_prompts, markdown, run_bench, write_report

    files = _prompt_files(prompt_files)
    genai = {}
    for item in genai_models:
        label, _, folder = item.rpartition("=")
        genai[label] = Path(folder)
    prompts = load_prompts(files, categories.split(",") if categories else None, per_category)
    if not prompts:
        raise SpecrtError("no prompts left: check --categories against the prompt files")
    stem = name or Path(bundles[0]).resolve().name
    drafts = tuple(int(n) for n in llama_cpp_drafts.split(",")) if llama_cpp_drafts else None
    if concurrency:
        from specrt.concurrency import bench_concurrency

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


@cli.command()
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
@click.option("--log-level", default="info", show_default=True)
@click.option("--ray", "on_ray", is_flag=True, help="Serve on Ray Serve (the ray extra).")
@click.option("--replicas", type=int, default=1, show_default=True, help="--ray: engine replicas.")
@click.option("--min-replicas", type=int, help="--ray: autoscale between this many...")
@click.option("--max-replicas", type=int, help="...and this many, on ongoing requests.")
@click.option("--ray-address", help="--ray: join this cluster (auto, ray://...) [default: local].")
def serve(
    bundle,
    host,
    port,
    max_batch,
    max_queue,
    timeout,
    controller,
    drafter,
    api_key,
    model_name,
    backend,
    threads,
    prompt_cache,
    prefill_chunk,
    log_level,
    on_ray,
    replicas,
    min_replicas,
    max_replicas,
    ray_address,
):
    """Serve BUNDLE over an OpenAI-compatible HTTP API (needs the serve extra); with --ray, as
    engine replicas on Ray Serve behind the same API (docs/ray.md)."""
    try:
        from specrt.serve.launch import serve as start
        from specrt.serve.settings import RayOptions, ServeSettings
    except ImportError as err:
        raise SpecrtError(
            f"specrt serve needs the serve extra: pip install 'specrt[serve]' ({err})"
        ) from err
    settings = ServeSettings(
        bundle=bundle,
        host=host,
        port=port,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout=timeout or None,
        controller=controller,
        drafter=drafter,
        api_key=api_key or None,
        model_name=model_name,
        backend=backend,
        threads=threads,
        prompt_cache=prompt_cache,
        prefill_chunk=prefill_chunk,
    )
    ray = RayOptions(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas)
    if not on_ray and (ray != RayOptions() or ray_address):
        raise SpecrtError("--replicas, --min-replicas, --max-replicas and --ray-address need --ray")
    start(settings, ray=ray if on_ray else None, address=ray_address, log_level=log_level, say=_log)


@cli.command()
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
    from specrt.doctor import render

    if gpu_json is not None:
        from specrt.gpucheck import report

        raise SystemExit(0 if report(gpu_json, list(bundles), _log, click.echo) else 1)
    click.echo(render(as_json, bundles))


cli.add_command(models)


def main() -> None:
    cli(prog_name="specrt")


if __name__ == "__main__":
    main()
