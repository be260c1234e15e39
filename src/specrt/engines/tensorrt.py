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
new positions; see docs/gpu.md.

Every address bound is a buffer of its own from cudaMalloc (256-byte aligned, as TensorRT wants
its I/O): a call's position ids are copied into their own small buffer rather than bound at an
offset into a table of all positions. The three profiles' execution contexts share one scratch
allocation (user-managed context memory: calls run one at a time on one stream), and the logits
buffer holds the most rows a call keeps (a verify window; a prefill keeps one).

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
from specrt.profiles import (
    Profile,
    cache_dims,
    kept_rows,
    profiles_from_manifest,
    select_profile,
)

INT64 = np.dtype(np.int64).itemsize
ALIGNMENT = 256  # bytes: TensorRT's requirement for every I/O tensor address


@dataclass(frozen=True)
class CallPlan:
    profile: int
    shapes: dict[str, tuple[int, ...]]  # every input's shape for this call
    positions: np.ndarray  # the new tokens' position ids, copied to their own device buffer
    keep: int  # value of the logits_to_keep shape input
    read: int  # which of the two cache buffers is the past (the other receives present)


@dataclass(frozen=True)
class DeviceBuffers:
    """Where each tensor lives on the device; every address comes from its own cudaMalloc."""

    ids: int
    positions: int
    mask: int
    keep: int  # 0 where logits_to_keep is a shape input, read from host memory
    logits: int
    caches: list[list[int]]  # [2][layer × (key, value)]: ping-pong pairs


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
    """How to bind one forward of `count` new tokens after `start` cached ones (the caches
    whole: TensorRT's profiles fix their shape)."""
    total = start + count
    shapes = {"input_ids": (1, count), "position_ids": (1, count), "attention_mask": (1, total)}
    for i in range(num_layers):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = cache_dims(1, capacity, num_kv_heads, head_dim)
    return CallPlan(
        profile=select_profile(profiles, count, total),
        shapes=shapes,
        positions=np.arange(start, total, dtype=np.int64),
        keep=keep,
        read=parity,
    )


def device_addresses(
    read: int, buffers: DeviceBuffers, cache_names: list[tuple[str, str]]
) -> dict[str, int]:
    """The device address of every tensor bound for a call that reads cache buffer `read` (a
    host shape input is not among them); `check_aligned` holds them to TensorRT's alignment."""
    addresses = {
        "input_ids": buffers.ids,
        "position_ids": buffers.positions,
        "attention_mask": buffers.mask,
        "logits": buffers.logits,
    }
    if buffers.keep:
        addresses["logits_to_keep"] = buffers.keep
    past, present = buffers.caches[read], buffers.caches[1 - read]
    for (past_name, present_name), src, dst in zip(cache_names, past, present, strict=True):
        addresses[past_name], addresses[present_name] = src, dst
    return addresses


def check_aligned(addresses: dict[str, int]) -> None:
    misaligned = {name: hex(a) for name, a in addresses.items() if a % ALIGNMENT}
    if misaligned:
        raise SpecrtError(
            f"TensorRT needs {ALIGNMENT}-byte aligned tensor addresses; these are not: {misaligned}"
        )


def _bind(context, name: str, address: int) -> None:
    if not context.set_tensor_address(name, address):
        raise SpecrtError(f"TensorRT refused the address of {name} (see its log above)")


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
            "the tensorrt backend needs TensorRT 10.1+ and cuda-bindings on a machine with an "
            f"NVIDIA GPU: pip install 'specrt[gpu]' (see docs/gpu.md) ({err})"
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
        self._parity = 0
        self._start_cache(1)
        self._contexts: dict[int, object] = {}
        self._allocations: list[int] = []
        self._stream = _cuda(self._cudart.cudaStreamCreate())
        self.stream = int(self._stream)  # TensorRT takes the raw handle
        self._trt = trt
        # One scratch for every profile's context: only one call runs at a time.
        self._scratch_bytes = self.engine.device_memory_size_v2
        self._scratch = self._malloc(self._scratch_bytes) if self._scratch_bytes else 0
        cache_type = trt.nptype(self.engine.get_tensor_dtype("past_key_values.0.key"))
        logits_type = trt.nptype(self.engine.get_tensor_dtype("logits"))
        cache_bytes = num_kv_heads * capacity * head_dim * np.dtype(cache_type).itemsize
        self._cache_names = [
            (f"past_key_values.{i}.{kind}", f"present.{i}.{kind}")
            for i in range(num_layers)
            for kind in ("key", "value")
        ]
        most = max(p.max_tokens for p in profiles)
        self._kept = kept_rows(profiles)
        self._logits = np.empty((self._kept, vocab_size), logits_type)
        self._keep = np.zeros(1, np.int64)
        # logits_to_keep sets an output shape, so TensorRT usually makes it a shape input, read
        # from host memory; where it does not, it is an ordinary device input.
        self._keep_on_host = self.engine.is_shape_inference_io("logits_to_keep")
        self._buffers = DeviceBuffers(
            ids=self._malloc(most * INT64),
            positions=self._malloc(most * INT64),
            mask=self._upload(np.ones(capacity, dtype=np.int64)),  # batch 1: no padding
            keep=0 if self._keep_on_host else self._malloc(INT64),
            logits=self._malloc(self._logits.nbytes),
            caches=[[self._malloc(cache_bytes) for _ in self._cache_names] for _ in range(2)],
        )
        # The buffers never move: both ping-pong bindings are checked once, here.
        self._addresses = [
            device_addresses(read, self._buffers, self._cache_names) for read in (0, 1)
        ]
        for addresses in self._addresses:
            check_aligned(addresses)

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
        if keep > self._kept:
            raise SpecrtError(
                f"the TensorRT engine returns the logits of at most {self._kept} positions a call "
                f"(a verify window; a prefill keeps its last), not {keep}"
            )
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
        buffers = self._buffers
        self._copy(buffers.ids, ids.ctypes.data, ids.nbytes, "cudaMemcpyHostToDevice")
        positions = plan.positions
        self._copy(
            buffers.positions, positions.ctypes.data, positions.nbytes, "cudaMemcpyHostToDevice"
        )
        for name, shape in plan.shapes.items():
            if not context.set_input_shape(name, shape):
                raise SpecrtError(f"TensorRT refused shape {shape} for {name} (outside profile)")
        self._keep[0] = plan.keep
        if self._keep_on_host:
            _bind(context, "logits_to_keep", self._keep.ctypes.data)
        else:
            self._copy(buffers.keep, self._keep.ctypes.data, INT64, "cudaMemcpyHostToDevice")
        for name, address in self._addresses[plan.read].items():
            _bind(context, name, address)
        if not context.execute_async_v3(self.stream):
            raise SpecrtError("TensorRT failed to run the engine (see its log above)")
        out = self._logits[:keep]
        self._copy(out.ctypes.data, buffers.logits, out.nbytes, "cudaMemcpyDeviceToHost")
        _cuda(self._cudart.cudaStreamSynchronize(self._stream))
        self._parity = 1 - plan.read
        self._wrote(0, tokens)
        return out.astype(np.float32)

    def close(self) -> None:
        """Free device memory and the stream now rather than at garbage collection."""
        self._contexts.clear()  # contexts hold the scratch; they go before it
        for pointer in self._allocations:
            self._cudart.cudaFree(pointer)
        self._allocations.clear()
        if self._stream is not None:
            self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None

    def __del__(self) -> None:
        if getattr(self, "_stream", None) is not None:
            self.close()

    def _context(self, index: int):
        """One execution context per profile, created when first needed."""
        if index not in self._contexts:
            strategy = self._trt.ExecutionContextAllocationStrategy.USER_MANAGED
            context = self.engine.create_execution_context(strategy)
            if self._scratch_bytes:
                context.set_device_memory(self._scratch, self._scratch_bytes)
            if not context.set_optimization_profile_async(index, self.stream):
                raise SpecrtError(f"TensorRT refused optimization profile {index}")
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
