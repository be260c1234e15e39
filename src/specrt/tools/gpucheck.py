"""`specrt doctor --gpu-check`: is every GPU path exact, and how fast, in one command.

A GPU is lent to this project's sessions only now and then, so one command must answer within
minutes, for each bundle and each GPU backend (PyTorch on CUDA, ONNX Runtime's CUDA and TensorRT
providers, native TensorRT engines): does speculation give the backend's own target-alone
tokens (it must, always), are those the float32 CPU target's tokens, how far its logits are from
the CPU engine's on a fixed prompt, and the tokens per second of the target alone and of
speculation. A backend that cannot run here is a row that says why ("not installed", "no CUDA
GPU", no engine in the bundle), never a silent gap; a backend that fails is a row with its error.

The bundles are the tiny one (built here when missing) and the built-in default pair where it has
been built (`specrt demo`); a TensorRT row needs a bundle built with `--backend tensorrt`, which
the check builds for the tiny pair when TensorRT is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.files import write_json_atomic
from specrt.tools.doctor import diagnose, probe

GPU_BACKENDS = ("torch-cuda", "onnxruntime-cuda", "onnxruntime-tensorrt", "tensorrt")
PROMPT = "def fibonacci(n):"
PROBE = [11, 12, 13, 14, 15]  # a verify-sized call after the prompt, for the logit check
Log = Callable[[str], None]


@dataclass
class Row:
    bundle: str
    backend: str
    status: str  # ok, not installed, no CUDA GPU, no bundle, no engine, failed
    detail: str = ""
    speculation_exact: bool | None = None  # speculative tokens == this backend's target alone
    same_as_cpu: bool | None = None  # target alone == the float32 CPU target alone
    max_logit_diff: float | None = None  # vs the CPU engine: a prefill's last row and a verify
    target_tok_s: float | None = None
    speculative_tok_s: float | None = None
    acceptance: float | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed" or False in (self.speculation_exact, self.same_as_cpu)


def unavailable(facts: dict) -> dict[str, str]:
    """Why each GPU backend cannot run here (absent: it can), from `specrt doctor`'s facts."""
    reasons = {v.backend: v.detail for v in diagnose(facts) if not v.ok}
    torch_gpu = facts.get("torch_cuda")
    if not facts.get("torch"):
        reasons["torch-cuda"] = "not installed: pip install 'specrt[export]'"
    elif not torch_gpu:
        reasons["torch-cuda"] = f"torch {facts['torch']} sees no CUDA GPU"
    return {backend: reasons[backend] for backend in GPU_BACKENDS if backend in reasons}


def torch_sees_a_gpu() -> bool:
    """Asked only where torch is installed: importing it costs seconds."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def check_backend(path: Path, backend: str, reference: dict, max_new_tokens: int) -> Row:
    """One bundle on one backend, against the CPU reference (`cpu_reference`)."""
    from specrt.runtime import SpeculativeRuntime

    bundle = Bundle.load(path)
    row = Row(str(path), backend, "ok")
    if backend == "tensorrt" and "tensorrt" not in bundle.role("target").info:
        row.status, row.detail = "no engine", "built without --backend tensorrt"
        return row
    runtime = SpeculativeRuntime.load(path, backend=backend, prompt_cache=False)
    row.max_logit_diff = _logit_diff(runtime.target, reference)
    runtime.generate(PROMPT, max_new_tokens=4)  # warm-up: first calls allocate and tune
    options = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    alone = runtime.generate(PROMPT, speculate=False, **options)
    spec = runtime.generate(PROMPT, controller="adaptive", **options)
    row.speculation_exact = spec.token_ids == alone.token_ids
    row.same_as_cpu = alone.token_ids == reference["tokens"]
    row.target_tok_s = round(alone.stats.tokens_per_second, 2)
    row.speculative_tok_s = round(spec.stats.tokens_per_second, 2)
    row.acceptance = round(spec.stats.acceptance_rate, 3)
    return row


def cpu_reference(path: Path, max_new_tokens: int) -> dict:
    """The float32 CPU target alone: its greedy tokens, and its logits on the fixed probe."""
    from specrt.runtime import SpeculativeRuntime

    runtime = SpeculativeRuntime.load(path, calibrate=False)
    options = {"max_new_tokens": max_new_tokens, "speculate": False, "ignore_eos": True}
    alone = runtime.generate(PROMPT, **options)
    prompt = runtime.encode(PROMPT)
    return {"tokens": alone.token_ids, "prompt": prompt, "logits": _probe(runtime.target, prompt)}


def _probe(engine, prompt: list[int]) -> list[np.ndarray]:
    """A prefill's last row, then a verify-sized call: the two shapes decoding uses most."""
    engine.reset()
    logits = [engine.forward(prompt, last=1), engine.forward(PROBE)]
    engine.reset()
    return logits


def _logit_diff(engine, reference: dict) -> float:
    got = _probe(engine, reference["prompt"])
    return max(float(np.abs(g - w).max()) for g, w in zip(got, reference["logits"], strict=True))


def default_bundles(reasons: dict[str, str], log: Log) -> list[Path]:
    """The tiny bundle (built here when missing; with TensorRT engines too where TensorRT can
    run, and with fp32 GPU graphs where onnxruntime-cuda can, so its row runs the batched
    attention and CUDA graphs, still exact against the CPU) and the built-in default pair's
    bundle, where `specrt demo` has built it."""
    from specrt.exporter.batched_attention import GpuGraph
    from specrt.tools.demo import default_bundle_path, tiny_bundle

    bundles = [tiny_bundle(log)]
    if "onnxruntime-cuda" not in reasons:
        bundles.append(tiny_bundle(log, gpu=GpuGraph("matmul", "fp32")))
    if "tensorrt" not in reasons:
        from specrt.exporter.tensorrt import TrtOptions
        from specrt.files import specrt_home

        cache = specrt_home() / "tiny" / "tensorrt.cache"
        bundles.append(tiny_bundle(log, TrtOptions("fp32", 2.0, cache)))
    return [*bundles, default_bundle_path()]


def run_check(
    bundles: list[Path] | None = None, max_new_tokens: int = 64, log: Log = print
) -> list[Row]:
    """Every bundle (default: `default_bundles`) on every GPU backend; a row for what cannot
    run says why. Without a CUDA GPU nothing is built or loaded."""
    facts = probe()
    facts["torch_cuda"] = torch_sees_a_gpu()
    reasons = unavailable(facts)
    no_gpu = not facts["gpus"] and not facts["torch_cuda"]
    if no_gpu:
        return [
            Row("-", backend, "no CUDA GPU", reasons.get(backend, "")) for backend in GPU_BACKENDS
        ]
    bundles = bundles or default_bundles(reasons, log)
    rows = []
    for path in bundles:
        if not (path / "manifest.json").is_file():
            rows += [Row(str(path), b, "no bundle", "not built here") for b in GPU_BACKENDS]
            continue
        runnable = any(b not in reasons for b in GPU_BACKENDS)
        reference = cpu_reference(path, max_new_tokens) if runnable else None
        for backend in GPU_BACKENDS:
            if backend in reasons:
                rows.append(Row(str(path), backend, "not installed", reasons[backend]))
                continue
            log(f"checking {path.name} on {backend}")
            try:
                rows.append(check_backend(path, backend, reference, max_new_tokens))
            except (SpecrtError, RuntimeError, OSError) as err:
                rows.append(Row(str(path), backend, "failed", str(err)))
    return rows


def render(rows: list[Row]) -> str:
    """A fixed-width table: one line per bundle and backend."""
    header = (
        f"{'bundle':28} {'backend':21} {'status':13} {'exact':5} {'=cpu':5} "
        f"{'max|dlogit|':>11} {'alone t/s':>9} {'spec t/s':>8} {'accept':>6}  detail"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{Path(r.bundle).name[:28]:28} {r.backend:21} {r.status:13} "
            f"{_yes(r.speculation_exact):5} {_yes(r.same_as_cpu):5} "
            f"{_num(r.max_logit_diff, '.1e'):>11} {_num(r.target_tok_s, '.1f'):>9} "
            f"{_num(r.speculative_tok_s, '.1f'):>8} {_num(r.acceptance, '.0%'):>6}  {r.detail}"
        )
    return "\n".join(lines)


def report(out: Path, bundles: list[Path], log: Log, echo: Log = print) -> bool:
    """Run the check (default bundles where none are given), print the table and write it as
    JSON to out, atomically; True where no row failed."""
    rows = run_check(bundles or None, log=log)
    echo(render(rows))
    write_json_atomic(out, {"prompt": PROMPT, "rows": [asdict(r) for r in rows]})
    return not any(r.failed for r in rows)


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
