"""ONNX Runtime's execution providers for a bundle: which one a backend names, with what
options, and whether it really starts.

- **float32 means float32.** The CUDA provider runs float32 MatMuls in TF32 unless told not to
  (`use_tf32`): on an H100 the float32 target then moved up to 1.7e-2 from the CPU's logits,
  against 9.9e-6 without TF32. The TensorRT provider has no such option; its builder honours
  `NVIDIA_TF32_OVERRIDE=0`, which a float32 graph on it sets for the process (unless the
  environment already says otherwise).
- **CUDA from pip.** onnxruntime-gpu finds CUDA and cuDNN from pip's `nvidia-*` wheels only
  after `onnxruntime.preload_dlls()` (otherwise only with LD_LIBRARY_PATH naming their
  folders), so a GPU provider's session is preceded by it, once.
- **Compiled in is not started.** `get_available_providers()` lists what the build carries, not
  what loads: a TensorRT provider whose libraries are missing is listed all the same, and a
  session silently falls back to the next provider. `check_providers` refuses that fall-back
  for an engine, and `starts` asks a session on a one-node graph, for `specrt doctor`.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence

import onnxruntime as ort

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.files import specrt_home
from specrt.profiles import input_shapes, keep_values, profiles_from_manifest

DEVICE_OF_PROVIDER = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}
CUDA = ("CUDAExecutionProvider", {"use_tf32": "0"})  # float32 MatMuls in float32
PROVIDER_OF_BACKEND = {
    "onnxruntime": "CPUExecutionProvider",
    "onnxruntime-cuda": "CUDAExecutionProvider",
    "onnxruntime-tensorrt": "TensorrtExecutionProvider",
}


def trt_profile_options(bundle: Bundle, role: str, slots: int = 1) -> dict[str, str]:
    """The bundle's prefill/decode/verify profiles as ONNX Runtime TensorRT provider options:
    one `name:dims` entry per input and profile, in profile order, for calls of 1..slots rows
    on the engine's caches (max context plus the margin). Every input TensorRT sees as dynamic
    is named, or the provider builds an engine for the first shape it meets and rebuilds on the
    next; `logits_to_keep` sets an output shape, so TensorRT makes it a shape tensor, whose entry
    gives its *values* (1 for a prefill, up to the window for a verify) rather than dims."""
    r = bundle.role(role)
    dims = {k: r.dim(k) for k in ("num_layers", "num_kv_heads", "head_dim")}
    lists: dict[str, list[str]] = {"min": [], "opt": [], "max": []}
    for profile in profiles_from_manifest(bundle.manifest):
        shapes = input_shapes(
            profile, capacity=bundle.max_context, batch=slots, margin=bundle.cache_margin, **dims
        )
        shapes["logits_to_keep"] = keep_values(profile)
        for name, bounds in shapes.items():
            for key, shape in zip(lists, bounds, strict=True):
                lists[key].append(f"{name}:{'x'.join(map(str, shape))}")
    return {f"trt_profile_{key}_shapes": ",".join(entries) for key, entries in lists.items()}


def providers_for(
    bundle: Bundle, role: str, backend: str, slots: int = 1, cuda_graphs: bool = False
) -> list:
    """Execution providers for a backend name and a bundle's role (the TensorRT provider's
    options come from the bundle); see `plain_providers` for the others."""
    if backend != "onnxruntime-tensorrt":
        return plain_providers(backend, cuda_graphs)
    provider = _available(backend)
    gpu_libraries()
    # The graph's own types decide the precision: fp16 kernels for an fp16 graph only, so a
    # float32 bundle stays float32 (and exact against the CPU target), TF32 off included.
    fp16 = bundle.role(role).precision == "fp16"
    if not fp16:
        os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    cache = specrt_home() / "ort-tensorrt" / bundle.path.resolve().name / role
    options = {
        **trt_profile_options(bundle, role, slots),
        "trt_fp16_enable": str(fp16),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": "True",
    }
    return [(provider, options), CUDA, "CPUExecutionProvider"]


def plain_providers(backend: str, cuda_graphs: bool = False) -> list:
    """Execution providers for `onnxruntime` or `onnxruntime-cuda`, which need no bundle;
    cuda_graphs: the CUDA provider captures and replays calls (engines/cuda_graphs.py)."""
    provider = _available(backend)
    if backend == "onnxruntime":
        return [provider]
    gpu_libraries()
    name, options = CUDA
    cuda = (name, {**options, "enable_cuda_graph": "1"}) if cuda_graphs else CUDA
    return [cuda, "CPUExecutionProvider"]


def _available(backend: str) -> str:
    """The backend's provider; one this onnxruntime build lacks is an error, not a silent
    fall-back to the CPU."""
    provider = PROVIDER_OF_BACKEND[backend]
    if provider not in ort.get_available_providers():
        raise SpecrtError(
            f"backend {backend}: this onnxruntime has no {provider} (it has "
            f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu, and TensorRT "
            "for the TensorRT provider (see docs/gpu.md)"
        )
    return provider


def check_providers(asked: Sequence[str | tuple[str, dict]], running: Sequence[str]) -> None:
    """Refuse a session whose first provider did not register. ONNX Runtime logs the reason
    (TensorRT or CUDA libraries not found, a driver too old) and carries on with the next
    provider in the list, so a GPU backend would run on the CPU, slowly, saying nothing."""
    first = provider_name(asked[0])
    if first not in running:
        raise SpecrtError(
            f"ONNX Runtime could not start {first} and fell back to "
            f"{', '.join(running) or 'nothing'}: its log above says why (usually CUDA, cuDNN or "
            "TensorRT libraries it cannot find, or onnxruntime and onnxruntime-gpu installed "
            "side by side; `specrt doctor` checks)"
        )


def provider_name(provider: str | tuple[str, dict]) -> str:
    """A provider entry's name: entries are a name, or a (name, options) pair."""
    return provider if isinstance(provider, str) else provider[0]


# y = x + x over float[1], opset 17 (made with onnx.helper; tests/test_gpu_plans.py remakes it):
# the smallest session a provider must start for.
PROBE_GRAPH = bytes.fromhex(
    "080812067370656372743a390a0e0a01780a01781201792203416464120570726f62655a0f0a0178120a0a"
    "08080112040a020801620f0a0179120a0a08080112040a02080142040a001011"
)


def starts(provider: str) -> str | None:
    """None where ONNX Runtime starts this provider, else why not."""
    if provider != "CPUExecutionProvider":
        gpu_libraries()
    try:
        with warnings.catch_warnings():  # "not in available provider names": said below
            warnings.simplefilter("ignore")
            providers = [provider, "CPUExecutionProvider"]
            session = ort.InferenceSession(PROBE_GRAPH, providers=providers)
    except Exception as err:  # ORT raises its own types when a provider fails loudly
        return f"starting it failed: {type(err).__name__}: {err}"
    running = session.get_providers()
    if running[0] != provider:
        return (
            f"it does not start (ONNX Runtime fell back to {', '.join(running)}; its log says "
            "why: usually CUDA, cuDNN or TensorRT libraries it cannot load)"
        )
    return None


@functools.cache
def gpu_libraries() -> None:
    """CUDA and cuDNN from pip's nvidia wheels, loaded before the first GPU session."""
    ort.preload_dlls()


COPIES = ("MemcpyFromHost", "MemcpyToHost")
CONTROL_FLOW = ("If", "Loop", "Scan")


def placement(graph, providers: list) -> dict[str, int]:
    """What ONNX Runtime made of a graph on these providers: the Memcpy nodes it added (each a
    copy between host and device, and a wait) and the control-flow nodes left (either rules
    out CUDA graphs), counted in the optimized graph a session writes, subgraphs included."""
    import tempfile
    from pathlib import Path

    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(written)
        options.log_severity_level = 3  # not the warning that the file suits this machine only
        # A model of gigabytes cannot be one protobuf: its weights go to a side file.
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.onnx.data"
        )
        ort.InferenceSession(str(graph), options, providers=providers)
        return count_nodes(onnx.load(str(written), load_external_data=False).graph)


def count_nodes(graph) -> dict[str, int]:
    """Memcpy and control-flow nodes in an ONNX graph and every subgraph of its nodes."""
    counts = {"memcpy": 0, "control_flow": 0}
    for node in graph.node:
        counts["memcpy"] += node.op_type in COPIES
        counts["control_flow"] += node.op_type in CONTROL_FLOW
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.HasField("g") else []
            for sub in subgraphs + list(attribute.graphs):
                for key, value in count_nodes(sub).items():
                    counts[key] += value
    return counts
