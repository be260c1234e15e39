"""The TensorRT code's CPU-testable parts, against small stand-ins for the `tensorrt` and
`cuda.bindings.runtime` modules (neither installs on a machine without an NVIDIA GPU; on one
that has them, tests/test_gpu_engines.py runs the real thing).

The stand-ins model only what the code asks: enums whose members differ between TensorRT 10 and
11, a builder config's timing-cache calls, and an engine whose context records every shape and
address it is given. Device memory is host memory from numpy, aligned as cudaMalloc aligns it,
so the engine's own copies really move bytes."""

from __future__ import annotations

import ctypes
import sys
import types
from enum import IntEnum

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.exporter.tensorrt import (
    TrtOptions,
    builder_flags,
    check_version,
    cleared_flags,
    network_flags,
    use_timing_cache,
)
from specrt.profiles import kept_rows, plan_profiles


class Creation(IntEnum):
    STRONGLY_TYPED = 5  # the value is TensorRT's own


class Flags10(IntEnum):  # TensorRT 10.x: weak-typing precision flags still exist
    FP16 = 0
    BF16 = 17
    TF32 = 6
    VERSION_COMPATIBLE = 11


class Flags11(IntEnum):  # TensorRT 11.x: FP16, BF16, INT8 and friends are gone
    TF32 = 6
    VERSION_COMPATIBLE = 11


def trt_of(flags) -> types.SimpleNamespace:
    return types.SimpleNamespace(BuilderFlag=flags, NetworkDefinitionCreationFlag=Creation)


@pytest.mark.parametrize("flags", [Flags10, Flags11], ids=["TensorRT 10", "TensorRT 11"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_builds_are_strongly_typed_and_fp32_means_fp32(flags, precision):
    trt = trt_of(flags)
    assert network_flags(trt) == 1 << 5
    options = TrtOptions(precision)
    set_flags = builder_flags(trt, options)
    assert not {"FP16", "BF16"} & {f.name for f in set_flags}  # the graph's types decide
    assert cleared_flags(trt, options) == ([flags.TF32] if precision == "fp32" else [])
    compatible = builder_flags(trt, TrtOptions(precision, version_compatible=True))
    assert compatible == [flags.VERSION_COMPATIBLE]


def test_only_fp16_and_fp32_engines_and_tensorrt_10_1_or_newer():
    with pytest.raises(SpecrtError, match="not one of fp16, fp32"):
        TrtOptions("bf16")
    for old in ("8.6.1", "10.0.1.6"):
        with pytest.raises(SpecrtError, match="needs TensorRT 10.1 or newer"):
            check_version(old)
    for supported in ("10.1.0", "10.16.1.11", "11.4.0.106"):
        check_version(supported)


class Config:
    """A builder config's timing-cache calls: a cache fits when its bytes were made 'here'."""

    def __init__(self, here: bytes):
        self.here, self.set_caches = here, []

    def create_timing_cache(self, data: bytes):
        if data and not data.startswith(b"cache"):
            raise RuntimeError("TensorRT: the timing cache is corrupt")
        return data

    def set_timing_cache(self, cache: bytes, ignore_mismatch: bool) -> bool:
        self.set_caches.append(cache)
        return not cache or cache == self.here


@pytest.mark.parametrize(
    "saved, kept",
    [(None, True), (b"cache:H100:10.16", True), (b"cache:A10:10.3", False), (b"\x00junk", False)],
    ids=["none yet", "this GPU's", "another GPU's", "corrupt"],
)
def test_a_timing_cache_that_does_not_fit_falls_back_to_an_empty_one(tmp_path, saved, kept):
    path = tmp_path / "timing.cache"
    if saved is not None:
        path.write_bytes(saved)
    config, messages = Config(b"cache:H100:10.16"), []
    use_timing_cache(config, path, messages.append)
    if kept:
        assert config.set_caches == [saved or b""] and messages == []
    else:
        assert config.set_caches[-1] == b"" and "another GPU or TensorRT version" in messages[0]


def test_logits_buffers_hold_a_verify_window_not_a_prompt():
    # The default pair: 2,048 positions, K_max 8, lookups of 32: a verify call keeps 33 rows.
    profiles = plan_profiles(2048, 32)
    assert kept_rows(profiles) == 33
    vocabulary = 151_936
    assert kept_rows(profiles) * vocabulary * 4 < 21e6  # was 2,048 rows: about 1.2 GB
    assert kept_rows(plan_profiles(128, 8)) == 9


# The engine, end to end on stand-ins.


class Memory:
    """cudaMalloc from host memory: every block starts on a 256-byte boundary."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}

    def malloc(self, size: int) -> int:
        block = np.zeros(size + 256, np.uint8)
        address = (block.ctypes.data + 255) // 256 * 256
        self.blocks[address] = block
        return address


def fake_cudart(memory: Memory, log: list) -> types.ModuleType:
    cudart = types.ModuleType("cuda.bindings.runtime")
    cudart.cudaError_t = types.SimpleNamespace(cudaSuccess=0)
    cudart.cudaMemcpyKind = types.SimpleNamespace(
        cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2
    )
    cudart.cudaMalloc = lambda size: (0, memory.malloc(size))
    cudart.cudaFree = lambda pointer: log.append(("free", pointer)) or (0,)
    cudart.cudaStreamCreate = lambda: (0, 77)
    cudart.cudaStreamDestroy = lambda stream: log.append(("destroy", stream)) or (0,)
    cudart.cudaStreamSynchronize = lambda stream: (0,)
    cudart.cudaGetErrorString = lambda error: (0, b"stand-in error")

    def copy(dst, src, size, kind, stream):
        ctypes.memmove(dst, src, size)
        return (0,)

    cudart.cudaMemcpyAsync = copy
    return cudart


class Context:
    def __init__(self, engine, strategy):
        self.engine, self.strategy = engine, strategy
        self.addresses, self.shapes, self.memory = {}, {}, None

    def set_device_memory(self, pointer, size):
        self.memory = (pointer, size)

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        self.engine.current = self
        return name not in self.engine.refuse

    def execute_async_v3(self, stream):
        kept = int(
            np.frombuffer(ctypes.string_at(self.addresses["logits_to_keep"], 8), np.int64)[0]
        )
        logits = (ctypes.c_float * (kept * self.engine.vocab)).from_address(
            self.addresses["logits"]
        )
        np.frombuffer(logits, np.float32)[:] = float(kept)  # something to read back
        return True


class Engine:
    device_memory_size_v2 = 1 << 20

    def __init__(self, vocab: int):
        self.vocab, self.refuse, self.contexts, self.current = vocab, set(), [], None

    def get_tensor_dtype(self, name):
        return np.float32

    def is_shape_inference_io(self, name):
        return name == "logits_to_keep"  # a shape input, read from host memory

    def create_execution_context(self, strategy):
        self.contexts.append(Context(self, strategy))
        return self.contexts[-1]


@pytest.fixture
def standins(monkeypatch):
    memory, log = Memory(), []
    engine = Engine(vocab=96)
    trt = types.ModuleType("tensorrt")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    runtime = types.SimpleNamespace(deserialize_cuda_engine=lambda plan: engine)
    trt.Runtime = lambda logger: runtime
    trt.nptype = lambda dtype: dtype
    trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(USER_MANAGED="user-managed")
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = fake_cudart(memory, log)
    cuda.bindings = bindings
    for name, module in [("tensorrt", trt), ("cuda", cuda), ("cuda.bindings", bindings)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", bindings.runtime)
    return engine, memory, log


def make_engine(tmp_path):
    from specrt.engines.tensorrt import TrtEngine

    plan = tmp_path / "model.plan"
    plan.write_bytes(b"plan")
    dims = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    return TrtEngine(plan, plan_profiles(128, 8), vocab_size=96, capacity=128, **dims)


def test_the_engine_binds_only_aligned_addresses_and_its_own_positions(standins, tmp_path):
    engine, memory, _ = standins
    trt_engine = make_engine(tmp_path)
    # a prefill of 12 (keeps 1 row), a decode, then verify calls at odd starts
    calls = [(list(range(12)), 1), ([7], None), ([8, 9, 10], None), ([11] * 9, None)]
    for tokens, last in calls:
        start = trt_engine.length
        logits = trt_engine.forward(tokens, last)
        assert logits.shape == (last or len(tokens), 96) and (logits == logits.shape[0]).all()
        context = engine.current
        bound = [context.addresses[n] for n in context.addresses if n != "logits_to_keep"]
        assert bound and all(address % 256 == 0 for address in bound)
        positions = context.addresses["position_ids"]
        copied = np.frombuffer(ctypes.string_at(positions, 8 * len(tokens)), np.int64)
        assert copied.tolist() == list(range(start, start + len(tokens)))
        assert context.shapes["position_ids"] == (1, len(tokens))
    # three profiles, three contexts: all on one user-managed scratch
    assert {c.strategy for c in engine.contexts} == {"user-managed"}
    assert len({c.memory for c in engine.contexts}) == 1 and len(engine.contexts) == 3
    # the logits buffer holds a verify window (9 rows), not the longest prompt (119)
    assert trt_engine._logits.shape == (9, 96)
    with pytest.raises(SpecrtError, match="at most 9 positions"):
        trt_engine.forward(list(range(20)))


def test_a_refused_address_is_a_clear_error_and_close_releases_everything(standins, tmp_path):
    engine, memory, log = standins
    trt_engine = make_engine(tmp_path)
    engine.refuse.add("present.1.value")
    with pytest.raises(SpecrtError, match="refused the address of present.1.value"):
        trt_engine.forward([1, 2, 3], last=1)
    trt_engine.close()
    assert ("destroy", 77) in log
    assert {pointer for kind, pointer in log if kind == "free"} == set(memory.blocks)
    trt_engine.close()  # twice is harmless
    assert log.count(("destroy", 77)) == 1


def test_the_old_offset_binding_would_have_been_caught():
    """Control: positions bound at base + start * 8 (the old layout) fail the check."""
    from specrt.engines.tensorrt import check_aligned

    base = Memory().malloc(1024)
    check_aligned({"position_ids": base})
    with pytest.raises(SpecrtError, match="256-byte aligned"):
        check_aligned({"position_ids": base + 20 * 8})
