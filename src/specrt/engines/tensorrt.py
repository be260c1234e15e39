"""TensorRT engine: a bundle's serialized plan, one execution context per shape profile.

Device memory and the stream come from cuda-python (`cuda.bindings.runtime`), not torch or CuPy:
it is a thin binding with no framework behind it, so the runtime stays as lean as with ONNX
Runtime (numpy, tensorrt, cuda-python).

Every call is planned by `call_plan`, a pure function (tested on CPU): which profile serves
this many new tokens, each input's shape, where the position ids start, and which cache buffer
is read and which written. The graph writes a whole present buffer (ScatterElements of the new
keys/values into a copy of the past), and TensorRT does not promise that an input and an output
may share memory for such a layer. So each layer has two cache buffers, read one and write the
other, and swap them after the call (ping-pong): one device-side copy of the cache per call (about
60 MB for a 1.5B model in fp16 at 2048 positions, some 20 µs on an H100), no host traffic, and
rollback still only moves a length. TensorRT 10.15's KV-cache update layer would write only the
new positions; see README, 'GPU'.

The attention mask's length (past + new) is a dynamic shape that changes every call, so CUDA graphs,
which fix shapes and addresses, are not captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.engines.base import BufferCache, OneSlot, check_room
from specrt.errors import SpecrtError
from specrt.profiles import Profile, profiles_from_manifest, select_profile

INT64 = np.dtype(np.int64).itemsize


@dataclass(frozen=True)
class CallPlan:
    profile: int
    shapes: dict[str, tuple[int, ...]]  # every input's shape for this call
    position_offset: int  # bytes into the device buffer holding 0..capacity-1
    keep: int  # value of the logits_to_keep shape input
    read: int  # which of the two cache buffers is the past (the other receives present)


def call_plan(
    profiles: list[Profile],
    *,
    count: int,
    start: int,
    keep: int,
    parity: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
) -> CallPlan:
    """How to bind one forward of `count` new tokens after `start` cached ones."""
    total = start + count
    shapes = {"input_ids": (1, count), "position_ids": (1, count), "attention_mask": (1, total)}
    for i in range(num_layers):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = (1, num_kv_heads, capacity, head_dim)
    return CallPlan(
        profile=select_profile(profiles, count, total),
        shapes=shapes,
        position_offset=start * INT64,
        keep=keep,
        read=parity,
    )


def _cuda(result):
    """cuda-python returns (error, value...); raise on error, return the value(s)."""
    from cuda.bindings import runtime as cudart

    error, *values = result
    if error != cudart.cudaError_t.cudaSuccess:
        raise SpecrtError(f"CUDA error: {cudart.cudaGetErrorString(error)[1].decode()}")
    return values[0] if len(values) == 1 else tuple(values)


def _import():
    try:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart
    except ImportError as err:
        raise SpecrtError(
            "the tensorrt backend needs TensorRT 10 and cuda-python on a machine with an NVIDIA "
            f"GPU: pip install 'specrt[gpu]' (see README, 'GPU') ({err})"
        ) from err
    return trt, cudart


class TrtEngine(OneSlot, BufferCache):
    def __init__(
        self,
        plan: Path,
        profiles: list[Profile],
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        capacity: int,
        version_compatible: bool = False,
    ):
        trt, self._cudart = _import()
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        runtime.engine_host_code_allowed = version_compatible
        self.engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise SpecrtError(
                f"{plan}: TensorRT cannot load this engine (built for another GPU or TensorRT "
                "version?); rebuild it here, or build with --version-compatible"
            )
        self.profiles = profiles
        self.vocab_size, self.capacity = vocab_size, capacity
        self._dims = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        self._lengths, self._parity = [0], 0
        self._contexts: dict[int, object] = {}
        self._allocations: list[int] = []
        self._stream = _cuda(self._cudart.cudaStreamCreate())
        self.stream = int(self._stream)  # TensorRT takes the raw handle
        cache_type = trt.nptype(self.engine.get_tensor_dtype("past_key_values.0.key"))
        logits_type = trt.nptype(self.engine.get_tensor_dtype("logits"))
        cache_bytes = num_kv_heads * capacity * head_dim * np.dtype(cache_type).itemsize
        self._cache_names = [
            (f"past_key_values.{i}.{kind}", f"present.{i}.{kind}")
            for i in range(num_layers)
            for kind in ("key", "value")
        ]
        self._caches = [[self._malloc(cache_bytes) for _ in self._cache_names] for _ in range(2)]
        most = max(p.max_tokens for p in profiles)
        self._ids = self._malloc(most * INT64)
        self._positions = self._upload(np.arange(capacity, dtype=np.int64))
        self._mask = self._upload(np.ones(capacity, dtype=np.int64))  # batch 1: no padding
        self._logits = np.empty((most, vocab_size), logits_type)
        self._device_logits = self._malloc(self._logits.nbytes)
        self._keep = np.zeros(1, np.int64)
        # logits_to_keep sets an output shape, so TensorRT usually makes it a shape input, read
        # from host memory; where it does not, it is an ordinary device input.
        self._keep_on_host = self.engine.is_shape_inference_io("logits_to_keep")
        self._device_keep = 0 if self._keep_on_host else self._malloc(INT64)

    @classmethod
    def from_bundle(cls, bundle: Bundle, role: str) -> TrtEngine:
        r = bundle.role(role)
        record = r.info.get("tensorrt")
        if record is None:
            raise SpecrtError(
                f"{bundle.path}: the {role} has no TensorRT engine; build the bundle with "
                "`specrt build --backend tensorrt`"
            )
        return cls(
            r.folder / record["plan"],
            profiles_from_manifest(bundle.manifest),
            num_layers=r.dim("num_layers"),
            num_kv_heads=r.dim("num_kv_heads"),
            head_dim=r.dim("head_dim"),
            vocab_size=r.dim("vocab_size"),
            capacity=bundle.max_context,
            version_compatible=record.get("version_compatible", False),
        )

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        keep = check_room(self, len(tokens), last)
        plan = call_plan(
            self.profiles,
            count=len(tokens),
            start=self._lengths[0],
            keep=keep,
            parity=self._parity,
            capacity=self.capacity,
            **self._dims,
        )
        context = self._context(plan.profile)
        ids = np.ascontiguousarray(tokens, dtype=np.int64)
        self._copy(self._ids, ids.ctypes.data, ids.nbytes, "cudaMemcpyHostToDevice")
        for name, shape in plan.shapes.items():
            if not context.set_input_shape(name, shape):
                raise SpecrtError(f"TensorRT refused shape {shape} for {name} (outside profile)")
        context.set_tensor_address("input_ids", self._ids)
        context.set_tensor_address("position_ids", self._positions + plan.position_offset)
        context.set_tensor_address("attention_mask", self._mask)
        self._keep[0] = plan.keep
        if self._keep_on_host:
            context.set_tensor_address("logits_to_keep", self._keep.ctypes.data)
        else:
            self._copy(self._device_keep, self._keep.ctypes.data, INT64, "cudaMemcpyHostToDevice")
            context.set_tensor_address("logits_to_keep", self._device_keep)
        past, present = self._caches[plan.read], self._caches[1 - plan.read]
        for (past_name, present_name), src, dst in zip(
            self._cache_names, past, present, strict=True
        ):
            context.set_tensor_address(past_name, src)
            context.set_tensor_address(present_name, dst)
        context.set_tensor_address("logits", self._device_logits)
        if not context.execute_async_v3(self.stream):
            raise SpecrtError("TensorRT failed to run the engine (see its log above)")
        out = self._logits[:keep]
        self._copy(out.ctypes.data, self._device_logits, out.nbytes, "cudaMemcpyDeviceToHost")
        _cuda(self._cudart.cudaStreamSynchronize(self._stream))
        self._parity = 1 - plan.read
        self._lengths[0] += len(tokens)
        return out.astype(np.float32)

    def close(self) -> None:
        """Free device memory now rather than at garbage collection."""
        for pointer in self._allocations:
            self._cudart.cudaFree(pointer)
        self._allocations.clear()

    def __del__(self) -> None:
        if getattr(self, "_allocations", None):
            self.close()

    def _context(self, index: int):
        """One execution context per profile, created when first needed."""
        if index not in self._contexts:
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream)
            self._contexts[index] = context
        return self._contexts[index]

    def _malloc(self, size: int) -> int:
        pointer = _cuda(self._cudart.cudaMalloc(size))
        self._allocations.append(pointer)
        return pointer

    def _upload(self, array: np.ndarray) -> int:
        pointer = self._malloc(array.nbytes)
        self._copy(pointer, array.ctypes.data, array.nbytes, "cudaMemcpyHostToDevice")
        _cuda(self._cudart.cudaStreamSynchronize(self._stream))
        return pointer

    def _copy(self, dst: int, src: int, size: int, kind: str) -> None:
        direction = getattr(self._cudart.cudaMemcpyKind, kind)
        _cuda(self._cudart.cudaMemcpyAsync(dst, src, size, direction, self._stream))
