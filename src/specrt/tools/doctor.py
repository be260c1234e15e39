"""`specrt doctor`: which backends this machine can run, and for each one that it cannot, why;
the CPU and its SIMD features; and, for bundles named, whether their targets' calls need padding
to even rows here (the row probe, see engines/rows.py).

Facts are gathered once (`probe`: versions, execution providers, whether each GPU provider
starts, GPUs) and judged by a pure function (`diagnose`), so the verdicts are tested on any
machine with facts written by hand. A provider compiled into onnxruntime is not one that starts
(a TensorRT provider whose libraries cannot load is listed all the same): each is asked to start
a session on a one-node graph.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specrt import machine

GPU_PROVIDERS = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
GPU_HINT = "on a machine with an NVIDIA GPU and driver: pip install 'specrt[gpu]'"
# The distributions that install each module, as pip names them: the `tensorrt` meta-package
# pulls tensorrt-cu13 (or -cu12), whose bindings wheel holds the module; cuda-python is a
# meta-package over cuda-bindings, which holds `cuda.bindings`.
DISTRIBUTIONS = {
    "onnxruntime": ("onnxruntime",),
    "onnxruntime_gpu": ("onnxruntime-gpu",),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "tensorrt": (
        "tensorrt",
        "tensorrt-cu13",
        "tensorrt-cu12",
        "tensorrt-cu13-bindings",
        "tensorrt-cu12-bindings",
    ),
    "cuda_python": ("cuda-bindings", "cuda-python"),
}
SIDE_BY_SIDE = (
    "onnxruntime and onnxruntime-gpu are both installed and share one module, so either can "
    "hide the other's providers: pip uninstall -y onnxruntime onnxruntime-gpu && "
    "pip install onnxruntime-gpu"
)


@dataclass(frozen=True)
class Verdict:
    backend: str
    ok: bool
    detail: str


def _version(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of these distributions that is installed."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def probe() -> dict:
    """What is installed and visible here (imports nothing heavy that is not installed)."""
    facts: dict = {name: _version(names) for name, names in DISTRIBUTIONS.items()}
    facts["providers"], facts["failed"] = [], {}
    if facts["onnxruntime"] or facts["onnxruntime_gpu"]:
        import onnxruntime

        from specrt.engines.ort_providers import starts

        facts["providers"] = onnxruntime.get_available_providers()
        for provider in GPU_PROVIDERS & set(facts["providers"]):
            if (why := starts(provider)) is not None:
                facts["failed"][provider] = why
    facts["gpus"] = _gpus()
    return facts


def _gpus() -> list[str]:
    """Names of the CUDA GPUs cuda-python can see ([] without cuda-python, driver or GPU)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return []
    error, count = cudart.cudaGetDeviceCount()
    if error != cudart.cudaError_t.cudaSuccess:
        return []
    names = []
    for index in range(count):
        error, props = cudart.cudaGetDeviceProperties(index)
        if error == cudart.cudaError_t.cudaSuccess:
            names.append(f"{props.name.decode()} (sm {props.major}.{props.minor})")
    return names


def diagnose(facts: dict) -> list[Verdict]:
    ort = facts.get("onnxruntime") or facts.get("onnxruntime_gpu")
    providers, gpus = facts.get("providers", []), facts.get("gpus", [])
    failed = facts.get("failed", {})
    trt = facts.get("tensorrt")
    both = bool(facts.get("onnxruntime") and facts.get("onnxruntime_gpu"))
    verdicts = [
        Verdict("onnxruntime", bool(ort), f"onnxruntime {ort}" if ort else "pip install specrt"),
        _provider("onnxruntime-cuda", "CUDAExecutionProvider", providers, failed, gpus, both),
        _provider(
            "onnxruntime-tensorrt", "TensorrtExecutionProvider", providers, failed, gpus, both
        ),
    ]
    if not trt:
        verdicts.append(Verdict("tensorrt", False, f"TensorRT is not installed; {GPU_HINT}"))
    elif tuple(int(part) for part in trt.split(".")[:2]) < (10, 1):
        verdicts.append(Verdict("tensorrt", False, f"TensorRT {trt} found; 10.1 or newer needed"))
    elif not facts.get("cuda_python"):
        verdicts.append(
            Verdict("tensorrt", False, "cuda-bindings is not installed: pip install cuda-bindings")
        )
    elif not gpus:
        verdicts.append(Verdict("tensorrt", False, f"TensorRT {trt}, but no CUDA GPU is visible"))
    else:
        verdicts.append(Verdict("tensorrt", True, f"TensorRT {trt} on {', '.join(gpus)}"))
    torch = facts.get("torch")
    verdicts.append(
        Verdict(
            "torch",
            bool(torch and facts.get("transformers")),
            f"torch {torch}, transformers {facts.get('transformers')}"
            if torch and facts.get("transformers")
            else "the reference backend and `specrt build` need: pip install 'specrt[export]'",
        )
    )
    return verdicts


def _provider(
    backend: str,
    provider: str,
    providers: list[str],
    failed: dict[str, str],
    gpus: list[str],
    side_by_side: bool,
) -> Verdict:
    """failed: the providers compiled in that did not start, with why. side_by_side:
    onnxruntime and onnxruntime-gpu both installed, the usual reason a GPU provider is missing
    (said as the cause where it is, as a warning where it is not yet)."""
    if provider not in providers:
        hint = SIDE_BY_SIDE if side_by_side else GPU_HINT
        return Verdict(backend, False, f"this onnxruntime has no {provider}; {hint}")
    if provider in failed:
        return Verdict(backend, False, f"{provider} is compiled in, but {failed[provider]}")
    if not gpus:
        return Verdict(backend, False, f"{provider} is installed, but no CUDA GPU is visible")
    warning = f" (warning: {SIDE_BY_SIDE})" if side_by_side else ""
    return Verdict(backend, True, f"{provider} on {', '.join(gpus)}{warning}")


def row_padding(bundles: Sequence[Path]) -> dict[str, dict]:
    """Each bundle's target as the ONNX Runtime engine probes it at load on this machine."""
    from specrt.bundle import Bundle
    from specrt.engines.onnxruntime import OrtEngine

    return {
        str(path): OrtEngine.from_bundle(Bundle.load(path), "target").row_probe.as_dict()
        for path in bundles
    }


def render(as_json: bool = False, bundles: Sequence[Path] = ()) -> str:
    """This machine's verdicts (a line per backend), its CPU, and each bundle's row padding;
    or all of it as JSON."""
    facts = probe()
    verdicts = diagnose(facts)
    cpu = machine.describe()
    padding = row_padding(bundles)
    if as_json:
        backends = [asdict(v) for v in verdicts]
        return json.dumps({"facts": facts, "machine": cpu, "backends": backends, "rows": padding})
    lines = [f"{v.backend:22} {'yes' if v.ok else 'no ':3}  {v.detail}" for v in verdicts]
    lines.append(f"{'cpu':22} {machine.label(cpu)}")
    lines += [f"{'target rows':22} {path}: {p['finding']}" for path, p in padding.items()]
    return "\n".join(lines)
