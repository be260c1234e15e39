"""`specrt build`, `specrt inspect`, `specrt eval`: make a bundle, show it, score its quality."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.common import log as _log
from specrt.files import specrt_home


@click.command()
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
    help="KV cache positions [default: the models' own context, e.g. 32768 for Qwen2.5].",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option(
    "--draft-precision",
    default=None,
    help="fp32|fp16|int8|int4|gguf. Changes acceptance only: outputs stay exact "
    "[default: int4, the fastest draft].",
)
@click.option(
    "--target-precision",
    default=None,
    help="fp32|fp16|int8|int4|gguf (a GGUF file's own blocks). Outputs are exact against it "
    "[default: gguf for a GGUF file, the model llama.cpp runs; fp32 otherwise].",
)
@click.option("--block-size", type=int, help="int8/int4 quantization block [default: 128].")
@click.option(
    "--accuracy-level",
    type=int,
    help="int8/int4 MatMulNBits compute: 4 = int8 activations, 0/1 = float32 [default: 4].",
)
@click.option(
    "--kv-cache",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    show_default=True,
    help="What both models keep keys and values in: float16 halves the cache's memory "
    "(outputs stay exact against the target built so; docs/precision.md says what it costs).",
)
@click.option(
    "--chat-template",
    type=click.Path(path_type=Path),
    help="A Jinja chat template stored in the bundle in place of the tokenizer's (for a model "
    "whose files carry none, or a fixed one).",
)
@click.option(
    "--backend",
    type=click.Choice(["onnxruntime", "onnxruntime-cuda", "tensorrt"]),
    default="onnxruntime",
    show_default=True,
    help="tensorrt also compiles each graph into a TensorRT engine (TensorRT 10.1+, a GPU); "
    "onnxruntime-cuda also writes each role a graph with batched attention for ONNX Runtime's "
    "CUDA provider (built and checked on any machine).",
)
@click.option(
    "--gpu-precision",
    type=click.Choice(["fp16", "fp32"]),
    default="fp16",
    show_default=True,
    help="onnxruntime-cuda: the GPU graph's precision (fp32: exact against the CPU graph).",
)
@click.option(
    "--gpu-attention",
    type=click.Choice(["matmul", "onnx"]),
    default="matmul",
    show_default=True,
    help="onnxruntime-cuda: MatMul/Softmax/MatMul, or ONNX's Attention op (opset 23).",
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
    draft_precision: str | None,
    target_precision: str | None,
    block_size: int | None,
    accuracy_level: int | None,
    kv_cache: str,
    chat_template: Path | None,
    backend: str,
    gpu_precision: str,
    gpu_attention: str,
    trt_precision: str,
    workspace: float,
    timing_cache: Path | None,
    version_compatible: bool,
):
    """Export DRAFT and TARGET to an ONNX bundle, checked against PyTorch."""
    from specrt.exporter.batched_attention import GpuGraph
    from specrt.exporter.build import build_bundle
    from specrt.exporter.precision import Precision, default_weights
    from specrt.exporter.tensorrt import TrtOptions
    from specrt.runtime.text import read_template

    tensorrt = None
    if backend == "tensorrt":
        tensorrt = TrtOptions(
            trt_precision,
            workspace,
            timing_cache or specrt_home() / "tensorrt.cache",
            version_compatible,
        )

    options = {"block_size": block_size, "accuracy_level": accuracy_level, "cache": kv_cache}
    options = {key: value for key, value in options.items() if value is not None}
    asked = {"draft": draft_precision, "target": target_precision}
    specs = {"draft": draft, "target": target}
    precision = {
        role: Precision(
            weights or default_weights(role, specs[role], tensorrt is not None), **options
        )
        for role, weights in asked.items()
        if specs[role] is not None
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
        gpu=GpuGraph(gpu_attention, gpu_precision) if backend == "onnxruntime-cuda" else None,
        chat_template=read_template(chat_template) if chat_template else None,
        log=_log,
    )
    click.echo(f"bundle written: {out}")


@click.command()
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
    from specrt.tools.inspection import bundle_lines

    for line in bundle_lines(loaded):
        click.echo(line)


@click.command("eval")
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
    from specrt.tools.quality import DEFAULT_TEXTS, evaluate, quality_lines

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
