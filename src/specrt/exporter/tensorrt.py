"""Compile a role's checked ONNX graph into a serialized TensorRT engine (TensorRT 10 Python API).

One optimization profile per call shape (prefill, decode, verify; see specrt.profiles), so each
is tuned for its typical case. The engine is stored beside the ONNX graph and described in the
manifest (TensorRT version, GPU and compute capability, precision, workspace, profiles), since a
plan only runs on the GPU generation and TensorRT version it was built for, unless it is built
version-compatible.

Where TensorRT or a GPU is missing, `require_tensorrt` says so before any export starts, so a
build never spends minutes and then fails, and no partial bundle is left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.files import write_bytes_atomic
from specrt.profiles import Profile, input_shapes, keep_values

PLAN = "model.plan"
TRT_PRECISIONS = ("fp16", "bf16", "fp32")
INSTALL_HINT = (
    "install TensorRT 10 on a machine with an NVIDIA GPU and driver: "
    "pip install tensorrt --extra-index-url https://pypi.nvidia.com (see README, 'GPU')"
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
    major = int(trt.__version__.split(".")[0])
    if major < 10:
        raise SpecrtError(f"--backend tensorrt needs TensorRT 10 or newer, found {trt.__version__}")
    gpu_name()  # raises when no GPU is visible
    return trt


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
) -> dict:
    """Write out/model.plan from graph; return its manifest record."""
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecrtError(f"{graph}: TensorRT cannot parse the graph (unsupported op?): {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30))
    if options.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    cache_bytes = _read_cache(options.timing_cache)
    config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)
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
        "workspace_gib": options.workspace_gib,
        "version_compatible": options.version_compatible,
        "profiles": [p.name for p in profiles],
        "kv_cache": "ping-pong",
    }


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
