"""ONNX Runtime engine: the bundle's graph with its KV cache preallocated and updated in place.

Each layer's key/value buffer is one OrtValue of [1, kv_heads, capacity, head_dim], bound through
IOBinding as both the `past` input and the `present` output, so the graph scatters new entries
into it and no step copies the cache. The current length lives in Python: rollback is setting an
int, and the next call's attention_mask length tells the graph where to write. Logits land in a
preallocated host buffer. Cache and logits take the graph's own float type (an fp16 graph keeps
an fp16 cache); the runtime always receives float32 logits. Imports neither torch nor
transformers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.bundle import Bundle
from specrt.engines.base import BufferCache, check_room
from specrt.errors import SpecrtError
from specrt.files import specrt_home
from specrt.profiles import input_shapes, profiles_from_manifest

DEVICE_OF_PROVIDER = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}
PROVIDER_OF_BACKEND = {
    "onnxruntime": "CPUExecutionProvider",
    "onnxruntime-cuda": "CUDAExecutionProvider",
    "onnxruntime-tensorrt": "TensorrtExecutionProvider",
}
FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def default_threads() -> int:
    """Decoding streams weights: one thread per core saturates memory bandwidth on small boxes."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def trt_profile_options(bundle: Bundle, role: str) -> dict[str, str]:
    """The bundle's prefill/decode/verify profiles as ONNX Runtime TensorRT provider options
    (one `name:dims` entry per input and profile, in profile order)."""
    r = bundle.role(role)
    dims = {k: r.dim(k) for k in ("num_layers", "num_kv_heads", "head_dim")}
    lists: dict[str, list[str]] = {"min": [], "opt": [], "max": []}
    for profile in profiles_from_manifest(bundle.manifest):
        shapes = input_shapes(profile, capacity=bundle.max_context, **dims)
        for name, bounds in shapes.items():
            if name == "logits_to_keep":  # static shape [1]: no range to give
                continue
            for key, shape in zip(lists, bounds, strict=True):
                lists[key].append(f"{name}:{'x'.join(map(str, shape))}")
    return {f"trt_profile_{key}_shapes": ",".join(entries) for key, entries in lists.items()}


def providers_for(bundle: Bundle, role: str, backend: str) -> list:
    """Execution providers for a backend name; a GPU provider that this onnxruntime build
    lacks is an error, not a silent fall-back to the CPU."""
    provider = PROVIDER_OF_BACKEND[backend]
    if provider not in ort.get_available_providers():
        raise SpecrtError(
            f"backend {backend}: this onnxruntime has no {provider} (it has "
            f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu, and TensorRT "
            "for the TensorRT provider (see README, 'GPU')"
        )
    if backend == "onnxruntime":
        return [provider]
    options: dict[str, str] = {}
    if backend == "onnxruntime-tensorrt":
        cache = specrt_home() / "ort-tensorrt" / bundle.path.resolve().name / role
        options = {
            **trt_profile_options(bundle, role),
            "trt_fp16_enable": "True",
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": "True",
        }
    return [(provider, options), "CUDAExecutionProvider", "CPUExecutionProvider"]


class OrtEngine(BufferCache):
    def __init__(
        self,
        graph: Path,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        capacity: int,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        threads: int | None = None,
        even_rows: bool = False,
    ):
        """even_rows: run every call on an even number of rows (see `forward`)."""
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or default_threads()
        options.inter_op_num_threads = 1
        # The draft and the target run in turn: a session's threads spin while it runs and stop
        # when its run ends, instead of spinning on the cores the other session needs. Measured
        # on 2 cores with an int4 pair: 19.6 tokens/s with ONNX Runtime's default, 32.5-34.3
        # with this (and 28-33 with spinning off altogether).
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = list(providers or ["CPUExecutionProvider"])
        try:
            self.session = ort.InferenceSession(str(graph), options, providers=providers)
        except Exception as err:  # ORT raises its own types for corrupt or unloadable graphs
            raise SpecrtError(f"{graph}: ONNX Runtime cannot load this graph: {err}") from err
        first = providers[0] if isinstance(providers[0], str) else providers[0][0]
        self.device = DEVICE_OF_PROVIDER.get(first, "cpu")
        self.vocab_size = vocab_size
        self.even_rows = even_rows
        self.capacity = capacity - 1 if even_rows else capacity  # room for the padding row
        self._length = 0
        self._binding = self.session.io_binding()
        types = {i.name: i.type for i in self.session.get_inputs()}
        types.update({o.name: o.type for o in self.session.get_outputs()})
        cache_type = FLOAT_TYPES[types["past_key_values.0.key"]]
        self._logits_type = FLOAT_TYPES[types["logits"]]
        shape = [1, num_kv_heads, capacity, head_dim]
        for i in range(num_layers):
            for kind in ("key", "value"):
                buffer = ort.OrtValue.ortvalue_from_shape_and_type(shape, cache_type, self.device)
                self._binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", buffer)
                self._binding.bind_ortvalue_output(f"present.{i}.{kind}", buffer)
        self._mask = np.ones((1, capacity), np.int64)
        self._positions = np.arange(capacity, dtype=np.int64)[None]
        self._logits = np.empty((1, 16, vocab_size), self._logits_type)

    @classmethod
    def from_bundle(
        cls, bundle: Bundle, role: str, backend: str = "onnxruntime", **options
    ) -> OrtEngine:
        r = bundle.role(role)
        options.setdefault("providers", providers_for(bundle, role, backend))
        # Only the target's numbers decide the output; a draft may differ between call shapes.
        options.setdefault("even_rows", role == "target" and r.precision in ("int8", "int4"))
        if role == "target" and r.precision == "fp16" and backend == "onnxruntime":
            raise SpecrtError(
                f"{bundle.path}: the target is fp16, which is meant for GPU providers. On CPU, "
                "ONNX Runtime's fp16 kernels give logits that depend on how many tokens a call "
                "carries (measured: 2e-3), so speculation could not promise the target's own "
                "tokens; build the target as fp32, int8 or int4 for CPU"
            )
        return cls(
            r.graph,
            num_layers=r.dim("num_layers"),
            num_kv_heads=r.dim("num_kv_heads"),
            head_dim=r.dim("head_dim"),
            vocab_size=r.dim("vocab_size"),
            capacity=bundle.max_context,
            **options,
        )

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        """Run the new tokens; with even_rows, an odd count gets one padding row after them.

        ONNX Runtime's MatMulNBits kernels (int8/int4) take activation rows in pairs and give an
        odd last row to a one-row kernel whose results differ (measured on the int4 1.5B target:
        up to 0.3 in a logit). A position's logits would then depend on how calls are cut, and
        a verify call of K+1 tokens would not reproduce one-token decoding. With every call even,
        every row goes through the pair kernel. The padding row sits after the real ones, so no
        real row attends to it, and its cache entry is overwritten by the next call; it costs
        one position of context and, on these kernels, next to no time (2 rows ≈ 1 row).
        """
        count = len(tokens)
        keep = check_room(self, count, last)
        pad = int(self.even_rows and count % 2 == 1)
        start, end = self._length, self._length + count
        ids = np.asarray([*tokens, *tokens[-1:] * pad], dtype=np.int64)[None]
        bind = self._binding
        bind.bind_cpu_input("input_ids", ids)
        bind.bind_cpu_input("attention_mask", self._mask[:, : end + pad])
        bind.bind_cpu_input("position_ids", self._positions[:, start : end + pad])
        bind.bind_cpu_input("logits_to_keep", np.array([keep + pad], dtype=np.int64))
        if keep + pad > self._logits.shape[1]:
            self._logits = np.empty((1, keep + pad, self.vocab_size), self._logits_type)
        out = self._logits[:, : keep + pad]
        bind.bind_output("logits", "cpu", 0, self._logits_type, list(out.shape), out.ctypes.data)
        self.session.run_with_iobinding(bind)
        self._length = end
        return out[0, :keep].astype(np.float32)
