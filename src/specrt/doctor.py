"""`specrt doctor`: which backends this machine can run, and for each one that it cannot, why.

Facts are gathered once (`probe`: versions, execution providers, GPUs) and judged by a pure
function (`diagnose`), so the verdicts are tested on any machine with facts written by hand.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

GPU_HINT = "on a machine with an NVIDIA GPU and driver: pip install 'specrt[gpu]'"


@dataclass(frozen=True)
class Verdict:
    backend: str
    ok: bool
    detail: str


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> dict:
    """What is installed and visible here (imports nothing heavy that is not installed)."""
    facts: dict = {
        name: _version(package)
        for name, package in (
            ("onnxruntime", "onnxruntime"),
            ("onnxruntime_gpu", "onnxruntime-gpu"),
            ("torch", "torch"),
            ("transformers", "transformers"),
            ("tensorrt", "tensorrt"),
            ("cuda_python", "cuda-python"),
        )
    }
    facts["providers"] = []
    if facts["onnxruntime"] or facts["onnxruntime_gpu"]:
        import onnxruntime

        facts["providers"] = onnxruntime.get_available_providers()
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
    trt = facts.get("tensorrt")
    verdicts = [
        Verdict("onnxruntime", bool(ort), f"onnxruntime {ort}" if ort else "pip install specrt"),
        _provider("onnxruntime-cuda", "CUDAExecutionProvider", providers, gpus),
        _provider("onnxruntime-tensorrt", "TensorrtExecutionProvider", providers, gpus),
    ]
    if not trt:
        verdicts.append(Verdict("tensorrt", False, f"TensorRT is not installed; {GPU_HINT}"))
    elif int(trt.split(".")[0]) < 10:
        verdicts.append(Verdict("tensorrt", False, f"TensorRT {trt} found; 10 or newer needed"))
    elif not facts.get("cuda_python"):
        verdicts.append(
            Verdict("tensorrt", False, "cuda-python is not installed: pip install cuda-python")
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


def _provider(backend: str, provider: str, providers: list[str], gpus: list[str]) -> Verdict:
    if provider not in providers:
        return Verdict(backend, False, f"this onnxruntime has no {provider}; {GPU_HINT}")
    if not gpus:
        return Verdict(backend, False, f"{provider} is installed, but no CUDA GPU is visible")
    return Verdict(backend, True, f"{provider} on {', '.join(gpus)}")
