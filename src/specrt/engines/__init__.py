"""Engines: one class per backend behind one protocol (see base.Engine).

Backends are imported only when asked for, so `import specrt.engines` stays as lean as the
backend in use: the onnxruntime engine never pulls in torch.
"""

from __future__ import annotations

from specrt.bundle import Bundle
from specrt.engines.base import Engine
from specrt.errors import SpecrtError

BACKENDS = (
    "onnxruntime",
    "onnxruntime-cuda",
    "onnxruntime-tensorrt",
    "tensorrt",
    "torch",
    "torch-cuda",
)


def load_engine(bundle: Bundle, role: str, backend: str = "onnxruntime", **options) -> Engine:
    """Open one role of a bundle on the named backend."""
    if backend.startswith("onnxruntime") and backend in BACKENDS:
        from specrt.engines.onnxruntime import OrtEngine

        return OrtEngine.from_bundle(bundle, role, backend, **options)
    if options.get("slots", 1) > 1 and not backend.startswith("onnxruntime"):
        raise SpecrtError(f"batching (slots > 1) needs an onnxruntime backend, not {backend}")
    options.pop("slots", None)
    if backend == "tensorrt":
        from specrt.engines.tensorrt import TrtEngine

        options.pop("threads", None)  # host threads do not apply to a GPU engine
        return TrtEngine.from_bundle(bundle, role, **options)
    if backend in ("torch", "torch-cuda"):
        if backend == "torch-cuda":
            options["device"] = "cuda"
        try:
            from specrt.engines.torch import TorchEngine
        except ImportError as err:
            raise SpecrtError(
                f"the torch backend needs the export extra: pip install 'specrt[export]' ({err})"
            ) from err
        return TorchEngine.from_bundle(bundle, role, **options)
    raise SpecrtError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Engine", "load_engine"]
