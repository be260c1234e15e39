"""Compile a role's checked ONNX graph into a serialized TensorRT engine (TensorRT 10.1 to 11.x).

Networks are strongly typed: each layer computes in its graph's own types. TensorRT 11 knows no
other mode (the FP16/BF16 builder flags are gone), and 10.x opts in with a creation flag, so one
build path serves both. An fp16 engine is therefore built from a copy of the float32 graph
converted to fp16 (specrt.exporter.precision, normalisation kept in float32); the bundle keeps
its float32 graph for the CPU. A float32 engine also clears TF32, which would otherwise round
matmul inputs to 10 mantissa bits: "fp32" means fp32.

One optimization profile per call shape (prefill, decode, verify; see specrt.profiles), so each
is tuned for its typical case. The engine is stored beside the ONNX graph and described in the
manifest (TensorRT version, GPU and compute capability, precision, workspace, profiles), since a
plan only runs on the GPU generation and TensorRT version it was built for, unless it is built
version-compatible.

Where TensorRT or a GPU is missing, `require_tensorrt` says so before any export starts, so a
build never spends minutes and then fails, and no partial bundle is left behind.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.exporter.precision import convert_float16
from specrt.files import write_bytes_atomic
from specrt.profiles import Profile, input_shapes, keep_values

PLAN = "model.plan"
TRT_PRECISIONS = ("fp16", "fp32")
OLDEST = (10, 1)  # shared execution-context memory (set_device_memory, device_memory_size_v2)
INSTALL_HINT = (
    "install TensorRT 10.1 or newer on a machine with an NVIDIA GPU and driver: "
    "pip install 'specrt[gpu]' (see docs/gpu.md)"
)


@dataclass(frozen=True)
class TrtOptions:
    precision: str = "fp16"
    workspace_gib: float = 4.0
    timing_cache: Path | None = None  # reused and updated across builds
    version_compatible: bool = False  # loadable by the lean runtime of later TensorRT versions

    def __post_init__(self) -> None:
        if self.precision not in TRT_PRECISIONS:
            raise SpecrtError(
                f"TensorRT precision {self.precision!r} is not one of {', '.join(TRT_PRECISIONS)}"
            )
        if self.workspace_gib <= 0:
            raise SpecrtError(f"workspace must be positive, got {self.workspace_gib} GiB")


def require_tensorrt():
    """The tensorrt module, once TensorRT and a CUDA GPU are known to be usable; else a clear
    error naming what to install."""
    try:
        import tensorrt as trt
    except ImportError as err:
        raise SpecrtError(f"--backend tensorrt: TensorRT is not installed; {INSTALL_HINT}") from err
    check_version(trt.__version__)
    gpu_name()  # raises when no GPU is visible
    return trt


def check_version(version: str) -> None:
    """TensorRT 10.1 or newer: strong typing and shared context memory are there in 10.1 to 11."""
    found = tuple(int(part) for part in version.split(".")[:2])
    if found < OLDEST:
        raise SpecrtError(
            f"--backend tensorrt needs TensorRT {'.'.join(map(str, OLDEST))} or newer, found "
            f"{version}; {INSTALL_HINT}"
        )


def gpu_name() -> tuple[str, str]:
    """(name, compute capability) of GPU 0, through PyTorch, which the exporter already needs."""
    import torch

    if not torch.cuda.is_available():
        raise SpecrtError(f"--backend tensorrt: no CUDA GPU is visible to PyTorch; {INSTALL_HINT}")
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def build_engine(
    graph: Path,
    out: Path,
    profiles: list[Profile],
    shape: dict,
    capacity: int,
    options: TrtOptions,
    log: Callable[[str], None] = print,
) -> dict:
    """Write out/model.plan from a float32 graph; return its manifest record."""
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    with _graph_at(graph, options.precision) as source:
        if not parser.parse_from_file(str(source)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise SpecrtError(
                f"{graph}: TensorRT cannot parse the graph (unsupported op?): {errors}"
            )
        config = builder.create_builder_config()
        config.set_memory_pool_limit(
            trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30)
        )
        for flag in builder_flags(trt, options):
            config.set_flag(flag)
        for flag in cleared_flags(trt, options):
            config.clear_flag(flag)
        use_timing_cache(config, options.timing_cache, log)
        shape_inputs = {
            network.get_input(i).name
            for i in range(network.num_inputs)
            if network.get_input(i).is_shape_tensor
        }
        for profile in profiles:
            config.add_optimization_profile(
                _trt_profile(builder, profile, shape, capacity, shape_inputs)
            )
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise SpecrtError(
            f"{graph}: TensorRT could not build an engine; its log above says why (out of GPU "
            "memory: lower --workspace or --max-context; a shape outside a profile; an "
            "unsupported layer)"
        )
    write_bytes_atomic(out / PLAN, bytes(plan))
    if options.timing_cache is not None:
        options.timing_cache.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(options.timing_cache, bytes(config.get_timing_cache().serialize()))
    name, capability = gpu_name()
    return {
        "plan": PLAN,
        "tensorrt_version": trt.__version__,
        "gpu": name,
        "compute_capability": capability,
        "precision": options.precision,
        "strongly_typed": True,
        "workspace_gib": options.workspace_gib,
        "version_compatible": options.version_compatible,
        "profiles": [p.name for p in profiles],
        "kv_cache": "ping-pong",
    }


def network_flags(trt) -> int:
    """Strongly typed on every version: required by 10.x to keep the graph's types, accepted
    and implied by 11.x."""
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def builder_flags(trt, options: TrtOptions) -> list:
    """Flags to set. None of them is a precision flag: those do not exist in TensorRT 11, and
    in a strongly typed network the graph's types decide."""
    return [trt.BuilderFlag.VERSION_COMPATIBLE] if options.version_compatible else []


def cleared_flags(trt, options: TrtOptions) -> list:
    """Flags to clear: TF32 (on by default) for a float32 engine, where it exists."""
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    return [tf32] if options.precision == "fp32" and tf32 is not None else []


@contextmanager
def _graph_at(graph: Path, precision: str) -> Iterator[Path]:
    """The graph TensorRT parses: the float32 one itself, or for an fp16 engine an fp16 copy in
    a temporary folder beside it, removed once the engine is built."""
    if precision == "fp32":
        yield graph
        return
    with tempfile.TemporaryDirectory(prefix="specrt-trt-", dir=graph.parent.parent) as folder:
        convert_float16(graph, Path(folder))
        yield Path(folder) / "model.onnx"


def use_timing_cache(config, path: Path | None, log: Callable[[str], None]) -> None:
    """Start from the saved timing cache where it fits this GPU and TensorRT version; a cache
    from another one (or a corrupt file) is set aside with a message and the build starts from
    an empty cache, which the build then saves in its place."""
    data = _read_cache(path)
    try:
        cache = config.create_timing_cache(data)
        fits = cache is not None and config.set_timing_cache(cache, ignore_mismatch=False)
    except Exception:  # TensorRT raises its own error types for bytes it cannot read
        fits = False
    if not fits:
        log(
            f"{path}: the timing cache was made by another GPU or TensorRT version, or is "
            "damaged; building with an empty one, which replaces it"
        )
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _trt_profile(builder, profile: Profile, shape: dict, capacity: int, shape_inputs: set[str]):
    trt_profile = builder.create_optimization_profile()
    shapes = input_shapes(
        profile,
        num_layers=shape["num_layers"],
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        capacity=capacity,
    )
    for name, (low, opt, high) in shapes.items():
        if name in shape_inputs:  # logits_to_keep sets an output shape: bounded by its value
            trt_profile.set_shape_input(name, *keep_values(profile))
        else:
            trt_profile.set_shape(name, low, opt, high)
    return trt_profile


def _read_cache(path: Path | None) -> bytes:
    if path is None or not path.is_file():
        return b""
    return path.read_bytes()
