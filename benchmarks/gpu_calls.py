"""What one engine call costs on a GPU, by backend, shape and precision, and what speculation
earns from those costs (issue 52's per-call table, as one command).

    python benchmarks/gpu_calls.py --out benchmarks/results/gpu-calls       # on a GPU machine
    python benchmarks/gpu_calls.py --device cpu --backends onnxruntime,torch --shapes tiny

A GPU machine is lent now and then, with no network, so this needs nothing but the tree and the
GPU image's packages (torch, transformers, onnx, onnxruntime-gpu carried in), and runs from an
empty cache: each shape (`specrt models synthetic`'s configs, real layer shapes) is written as a
Hugging Face folder with seeded random weights and a 384-token vocabulary (so the LM head does
not hide the layers), exported with the exporter's own `write_graph`, fp16 converted as the
builder converts it. Then, per backend, shape and precision, the median of `--repeat` calls
after a prompt of `--prompt` tokens: a prefill, a decode (1 token), verify calls of each width,
and a decode of 8 rows at once (the ONNX Runtime engine's batch; the PyTorch ones hold one).

Backends: `onnxruntime-cuda` (specrt's GPU engine: the CUDA provider, TF32 off), `torch` (eager
transformers with its dynamic cache, what `--backend torch-cuda` runs) and `torch-compile`
(transformers with a static cache, each call shape compiled with `torch.compile`: the strongest
PyTorch baseline a user would pick). An ONNX Runtime backend runs once per `--attentions`:
`in_place` is the CPU graph (a lone row read in place, a Loop over a batch's rows), `matmul` and
`onnx` the GPU graph's batched attention (exporter/batched_attention.py), each also with its
decode and verify calls replayed from CUDA graphs (`matmul+graphs`, engines/cuda_graphs.py), so
one run says which the GPU build should default to and what the graphs save. `--device cpu`
with `onnxruntime` runs the same path on the CPU (what CI tests).

Speculation is priced, not run: `tools/replay.py` replays the real controllers on the acceptance
the default pair recorded on the CPU (Qwen2.5-Coder 0.5B int4 drafting for the 1.5B GGUF
target, 8 prompts of 128 tokens; greedy acceptance does not depend on the machine), with the
draft shape's decode and the target shape's verify curve as the costs: tokens per second of the
target alone (K = 0), the best fixed K and adaptive, and adaptive against `torch-compile`'s
target decoding alone.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.bundle import CACHE_MARGIN
from specrt.files import write_result

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "acceptance-qwen2.5-coder-gguf.json"
VOCAB = 384
TINY = {  # --shapes tiny: a Qwen2-shaped model small enough for CI
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "_qkv_bias": True,
}
DRAFT, TARGET = "qwen2.5-0.5b", "qwen2.5-1.5b"  # the default pair's shapes


def shape_config(name: str) -> dict:
    from specrt.tools.synthetic import CONFIGS

    return {**(TINY if name == "tiny" else CONFIGS[name]), "vocab_size": VOCAB}


def checkpoint(name: str, cache: Path, log) -> Path:
    """The shape as a Hugging Face folder of seeded random weights (made once)."""
    from specrt.tools.synthetic import write_safetensors

    folder = cache / name / "hf"
    if not (folder / "model.safetensors").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        config = shape_config(name)
        public = {k: v for k, v in config.items() if not k.startswith("_")}
        (folder / "config.json").write_text(json.dumps(public, indent=2))
        log(f"{name}: writing random weights")
        write_safetensors(config, folder / "model.safetensors.partial", 0, lambda _: None)
        (folder / "model.safetensors.partial").rename(folder / "model.safetensors")
    return folder


def graph(name: str, folder: Path, precision: str, attention: str, options: dict, log) -> Path:
    """The exporter's graph of the shape with this attention (the CPU graph's `in_place`, or
    a form of the GPU graph's batched one), fp32 or fp16 converted from it, made once."""
    from specrt.exporter.graph import write_graph
    from specrt.exporter.precision import convert_float16
    from specrt.exporter.tensors import open_weights
    from specrt.sources import Source

    capacity = options["capacity"]
    out = options["cache"] / name / f"onnx-{attention}-{precision}-{capacity}"
    if (out / "model.onnx").is_file():
        return out / "model.onnx"
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    if precision == "fp16":
        source = graph(name, folder, "fp32", attention, options, log)
        log(f"{name}: converting to fp16")
        convert_float16(source, partial)
    else:
        log(f"{name}: exporting the fp32 graph ({attention} attention)")
        tensors = open_weights(Source.parse(str(folder)))
        write_graph(tensors, partial, capacity + CACHE_MARGIN, attention=attention)
    partial.rename(out)
    return out / "model.onnx"


def median_ms(call, repeat: int) -> float:
    """The median of `repeat` timed calls after two warm-ups. Each call returns host logits,
    so the device has finished when it returns."""
    call()
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 3)


def time_engine(engine, prompt: int, widths: list[int], rows: int, repeat: int) -> dict:
    """Prefill, decode, verify by width and (where the engine holds several) a batched decode,
    each on top of a prompt of `prompt` tokens, rolled back after every call."""
    ids = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, prompt + 32)]

    def prefill() -> None:
        engine.reset()
        engine.forward(ids[:prompt], last=1)

    def call(width: int):
        def run() -> None:
            engine.forward(ids[prompt : prompt + width])
            engine.rollback(prompt)

        return run

    timings = {"prefill_ms": median_ms(prefill, repeat)}
    prefill()
    verify = {w: median_ms(call(w), repeat) for w in widths}
    timings |= {"decode_ms": verify.get(1), "verify_ms": verify}
    if getattr(engine, "slots", 1) >= rows:
        for slot in range(rows):
            engine.reset(slot)
            engine.forward_rows([(slot, ids[:prompt])], last=1)

        def batch() -> None:
            engine.forward_rows([(slot, [ids[prompt]]) for slot in range(rows)])
            for slot in range(rows):
                engine.rollback(prompt, slot)

        timings["batch8_decode_ms"] = median_ms(batch, repeat)
        timings |= drift(engine, ids[prompt : prompt + 5], prompt, rows)
    return timings


def drift(engine, new: list[int], prompt: int, rows: int) -> dict:
    """How far a row's logits move with the call around it (speculation's exactness rests on
    it not moving): its decode alone against the same call in a batch of `rows` equal rows,
    and a verify of its next 5 tokens against 5 decodes. The CPU's kernels give 0.0 here
    (the engine's row probe checks it); a GPU's are measured, not assumed."""

    def call(calls: list) -> list:
        out = engine.forward_rows(calls)
        for slot, _ in calls:
            engine.rollback(prompt, slot)
        return out

    alone = call([(0, new[:1])])[0]
    batched = call([(slot, new[:1]) for slot in range(rows)])[0]
    verify = call([(0, new)])[0]
    steps = [engine.forward_rows([(0, [token])])[0] for token in new]  # one call a token
    engine.rollback(prompt, 0)
    return {
        "row_alone_vs_batch_max": float(np.abs(alone - batched).max()),
        "verify5_vs_decodes_max": float(np.abs(verify - np.concatenate(steps)).max()),
    }


def ort_engine(path: Path, name: str, backend: str, capacity: int, rows: int, graphs: int = 0):
    """The ONNX Runtime engine on this graph; graphs: the widest call replayed from a CUDA
    graph (0: none)."""
    from specrt.engines.onnxruntime import OrtEngine
    from specrt.engines.ort_providers import plain_providers

    config = shape_config(name)
    heads = config["num_attention_heads"]
    return OrtEngine(
        path,
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["hidden_size"] // heads,
        vocab_size=VOCAB,
        capacity=capacity,
        margin=CACHE_MARGIN,
        slots=rows,
        providers=plain_providers(backend, bool(graphs)),
        cuda_graphs=graphs,
    )


def torch_model(folder: Path, precision: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if precision == "fp16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here too
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


class CompiledStatic:
    """transformers with a static cache, each call shape compiled once (`torch.compile`,
    CUDA graphs on a GPU): one slot, the engine calls `time_engine` makes."""

    slots = 1

    def __init__(self, model, capacity: int, device: str, backend: str):
        import torch
        from transformers import StaticCache

        self.torch, self.model, self.device = torch, model, device
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        mode = "reduce-overhead" if device == "cuda" and backend == "inductor" else None
        self.step = torch.compile(model.forward, mode=mode, backend=backend, fullgraph=True)
        self.length = 0

    def reset(self, slot: int = 0) -> None:
        with self.torch.inference_mode():  # the cache's tensors were made in it
            self.cache.reset()
        self.length = 0

    def rollback(self, length: int, slot: int = 0) -> None:
        self.length = length  # the next call writes from here; the mask hides the rest

    def forward(self, tokens, last: int | None = None) -> np.ndarray:
        torch = self.torch
        ids = torch.tensor([list(tokens)], device=self.device)
        where = torch.arange(self.length, self.length + len(tokens), device=self.device)
        run = self.model.forward if self.length == 0 else self.step  # prefill stays eager
        with torch.inference_mode():
            out = run(input_ids=ids, cache_position=where, past_key_values=self.cache)
        self.length += len(tokens)
        return out.logits[0, -(last or len(tokens)) :].float().cpu().numpy()


def measure(options: dict, log) -> list[dict]:
    """Every (backend, attention, shape, precision) row; a row that cannot run says why."""
    rows = []
    for name in options["shapes"]:
        folder = checkpoint(name, options["cache"], log)
        for precision in options["precisions"]:
            for backend, attention in _variants(options):
                row = {"backend": backend, "shape": name, "precision": precision}
                row |= {"attention": attention} if attention else {}
                log(f"{name} {precision} {label(row)}")
                try:
                    engine = _engine(backend, attention, name, folder, precision, options, log)
                    calls = (options["prompt"], options["widths"], 8, options["repeat"])
                    row |= time_engine(engine, *calls)
                    row["status"] = "ok"
                except Exception as err:  # a row says what failed, the rest still run
                    row |= {"status": "failed", "detail": f"{type(err).__name__}: {err}"}
                    log(f"  failed: {row['detail']}")
                rows.append(row)
    return rows


def _variants(options: dict) -> list[tuple[str, str | None]]:
    """(backend, attention): an ONNX Runtime backend once per attention asked for."""
    return [
        (backend, attention)
        for backend in options["backends"]
        for attention in (options["attentions"] if backend.startswith("onnxruntime") else [None])
    ]


def label(row: dict) -> str:
    """A row's backend as the tables name it: `onnxruntime-cuda` for the CPU graph's
    attention, `onnxruntime-cuda (matmul)` for a form of the GPU graph's."""
    attention = row.get("attention")
    return row["backend"] if attention in (None, "in_place") else f"{row['backend']} ({attention})"


def _engine(backend, attention, name, folder, precision, options, log):
    capacity, device = options["capacity"], options["device"]
    if backend.startswith("onnxruntime"):
        form, _, graphs = attention.partition("+")  # matmul+graphs: replayed CUDA graphs
        path = graph(name, folder, precision, form, options, log)
        widest = max(options["widths"]) if graphs else 0
        return ort_engine(path, name, backend, capacity, 8, widest)
    from specrt.engines.torch import TorchEngine

    model = torch_model(folder, precision, device)
    if backend == "torch":
        return TorchEngine(model, capacity, device=device)
    return CompiledStatic(model, capacity, device, options["compile_backend"])


def _row(rows: list[dict], backend: str, shape: str, precision: str) -> dict | None:
    """The measured row of this backend (as `label` names it), shape and precision, if it ran."""
    wanted = (backend, shape, precision, "ok")
    found = [r for r in rows if (label(r), r["shape"], r["precision"], r["status"]) == wanted]
    return found[0] if found else None


def price(rows: list[dict], backend: str, precision: str, pair: tuple, traces: Path) -> dict | None:
    """Speculation's tokens/s from the draft shape's calls and the target shape's verify curve
    on one backend and precision, replayed on the recorded acceptance; beside the strongest
    PyTorch baseline, torch.compile's target alone at its faster precision."""
    from specrt.runtime.costs import StepCosts
    from specrt.tools import replay

    draft, target = (_row(rows, backend, shape, precision) for shape in pair)
    if draft is None or target is None:
        return None
    # A draft step of n tokens (a catch-up) costs what a call of n tokens does.
    costs = StepCosts(
        draft={int(w): ms / 1000 for w, ms in draft["verify_ms"].items()},
        verify={int(w): ms / 1000 for w, ms in target["verify_ms"].items()},
    )
    recorded = replay.load(traces)
    names = [f"fixed:{k}" for k in range(9)] + ["adaptive"]
    rates = {n: round(replay.replay(recorded, n, 1, costs).tokens_per_s, 1) for n in names}
    compiled = [_row(rows, "torch-compile", pair[1], p) for p in ("fp32", "fp16")]
    baseline = max((1000 / r["decode_ms"] for r in compiled if r), default=None)
    return {
        "backend": backend,
        "precision": precision,
        "tokens_per_s": rates,
        "adaptive_vs_alone": round(rates["adaptive"] / rates["fixed:0"], 2),
        "adaptive_vs_torch_compile": round(rates["adaptive"] / baseline, 2) if baseline else None,
    }


def gpu_name(device: str) -> str:
    if device != "cuda":
        return "none (CPU run)"
    import torch

    return torch.cuda.get_device_name(0)


def markdown(result: dict) -> str:
    widths = result["options"]["widths"]
    lines = [
        f"**Measured on {result['gpu']}**, {machine.label(result['machine'])}; "
        f"{result['machine']['date']}. `{result['command']}`",
        "",
        "| shape | backend | precision | prefill "
        + str(result["options"]["prompt"])
        + " | "
        + " | ".join(f"w={w}" for w in widths)
        + " | 8 rows, w=1 | max Δ alone/8 rows | max Δ verify 5/decodes |",
        "|---" * (4 + len(widths) + 3) + "|",
    ]
    for row in result["rows"]:
        head = f"| {row['shape']} | {label(row)} | {row['precision']} | "
        if row["status"] != "ok":
            lines.append(f"{head}{row['status']}: {row['detail'][:80]} |")
            continue
        cells = [_ms(row["prefill_ms"])] + [_ms(row["verify_ms"].get(w)) for w in widths]
        cells.append(_ms(row.get("batch8_decode_ms")))
        drifts = (row.get(k) for k in ("row_alone_vs_batch_max", "verify5_vs_decodes_max"))
        cells += ["—" if d is None else f"{d:.1e}" for d in drifts]
        lines.append(head + " | ".join(cells) + " |")
    for priced in result["priced"]:
        rates = priced["tokens_per_s"]
        best = max((rate, name) for name, rate in rates.items() if name != "adaptive")
        lines.append(
            f"\nPriced on {priced['backend']} {priced['precision']}: target alone "
            f"{rates['fixed:0']} tok/s, best fixed K ({best[1]}) {best[0]}, adaptive "
            f"{rates['adaptive']} ({priced['adaptive_vs_alone']}x the target alone"
            + _beside(priced["adaptive_vs_torch_compile"])
        )
    return "\n".join(lines) + "\n"


def _beside(ratio: float | None) -> str:
    return ")." if ratio is None else f", {ratio}x torch.compile's target alone)."


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@click.command()
@click.option("--shapes", default=f"{DRAFT},{TARGET}", show_default=True)
@click.option("--with-7b", is_flag=True, help="Add qwen2.5-7b (its export takes minutes).")
@click.option("--backends", default="onnxruntime-cuda,torch,torch-compile", show_default=True)
@click.option("--precisions", default="fp32,fp16", show_default=True)
@click.option(
    "--attentions",
    default="in_place,matmul,matmul+graphs,onnx,onnx+graphs",
    show_default=True,
    help="ONNX Runtime's graphs: the CPU graph's attention, the GPU graph's forms (+graphs: "
    "decode and verify replayed from CUDA graphs).",
)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--prompt", default=256, show_default=True, help="Tokens before each call.")
@click.option("--widths", default="1,5,17", show_default=True, help="Verify widths (1: decode).")
@click.option("--repeat", default=20, show_default=True)
@click.option("--capacity", default=1024, show_default=True, help="Cache positions.")
@click.option("--compile-backend", default="inductor", show_default=True)
@click.option("--pair", default=f"{DRAFT},{TARGET}", show_default=True, help="Shapes priced.")
@click.option("--traces", type=click.Path(path_type=Path), default=TRACES)
@click.option("--cache", type=click.Path(path_type=Path), default=Path("/tmp/specrt-gpu-calls"))
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(**options) -> None:
    shapes = _csv(options["shapes"]) + (["qwen2.5-7b"] if options["with_7b"] else [])
    settings = {
        "shapes": shapes,
        "backends": _csv(options["backends"]),
        "precisions": _csv(options["precisions"]),
        "attentions": _csv(options["attentions"]),
        "widths": [int(w) for w in _csv(options["widths"])],
        **{k: options[k] for k in ("device", "prompt", "repeat", "capacity", "compile_backend")},
    }
    settings["cache"] = options["cache"]
    pair = tuple(_csv(options["pair"]))
    started = time.perf_counter()
    rows = measure(settings, lambda line: click.echo(line, err=True))
    del settings["cache"]  # a machine's folder: not in the result
    priced = [
        p
        for backend in dict.fromkeys(label(row) for row in rows)
        for precision in settings["precisions"]
        if (p := price(rows, backend, precision, pair, options["traces"])) is not None
    ]
    result = {
        "kind": "gpu-calls",
        "gpu": gpu_name(settings["device"]),
        "machine": machine.describe(),
        "command": "python benchmarks/gpu_calls.py " + " ".join(sys.argv[1:]),
        "options": settings,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
        "priced": priced,
    }
    text = markdown(result)
    click.echo(text)
    write_result(options["out"], result, text)


if __name__ == "__main__":
    main()
