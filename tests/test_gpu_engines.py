"""GPU engines end to end. They run wherever `specrt doctor` says the backend can (TensorRT or
onnxruntime-gpu, and a CUDA GPU); elsewhere each test is skipped with that verdict as its reason
(pytest prints it: addopts = -ra). CI on this project's machines has neither, see docs/gpu.md."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.runtime import SpeculativeRuntime
from specrt.tools.doctor import diagnose, probe

VERDICTS = {v.backend: v for v in diagnose(probe())}
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]
CONTROLLERS = ["fixed:1", "fixed:8", "adaptive"]


def needs(backend: str):
    verdict = VERDICTS[backend]
    return pytest.mark.skipif(not verdict.ok, reason=f"{backend}: {verdict.detail}")


def _greedy_equals_target_alone(rt: SpeculativeRuntime) -> None:
    for prompt in PROMPTS:
        alone = rt.generate(prompt, max_new_tokens=32, speculate=False, ignore_eos=True)
        for controller in CONTROLLERS:
            spec = rt.generate(prompt, max_new_tokens=32, controller=controller, ignore_eos=True)
            assert spec.token_ids == alone.token_ids, (prompt, controller)


def _close_to_cpu(bundle: Bundle, backend: str) -> None:
    """A prefill, a decode and a verify give the CPU engine's logits (float32 throughout)."""
    cpu, gpu = (load_engine(bundle, "target", name) for name in ("onnxruntime", backend))
    for tokens, last in (([5, 6, 7, 8, 9, 10], 1), ([11], None), ([12, 13, 14, 15, 16], None)):
        want, got = cpu.forward(tokens, last), gpu.forward(tokens, last)
        assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    cpu.rollback(7)
    gpu.rollback(7)
    assert np.allclose(gpu.forward([20, 21]), cpu.forward([20, 21]), atol=1e-3, rtol=1e-3)


@needs("onnxruntime-cuda")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_onnxruntime_cuda(bundles, arch):
    _close_to_cpu(Bundle.load(bundles[arch]), "onnxruntime-cuda")
    _greedy_equals_target_alone(SpeculativeRuntime.load(bundles[arch], backend="onnxruntime-cuda"))


@pytest.fixture(scope="module")
def gpu_graph_bundles(pairs, tmp_path_factory) -> dict:
    """The llama pair with GPU graphs (batched attention) of each form, fp16 and fp32."""
    from specrt.exporter.batched_attention import FORMS, GpuGraph
    from specrt.exporter.build import build_bundle

    root, (draft, target) = tmp_path_factory.mktemp("gpu-graphs"), pairs["llama"]
    return {
        (form, precision): build_bundle(
            str(draft),
            str(target),
            root / f"{form}-{precision}",
            max_context=256,
            gpu=GpuGraph(form, precision),
            log=print,
        )
        for form in FORMS
        for precision in ("fp16", "fp32")
    }


@needs("onnxruntime-cuda")
@pytest.mark.parametrize("form", ["matmul", "onnx"])
def test_the_gpu_graph_has_no_copies_on_cuda(gpu_graph_bundles, form):
    """No Memcpy node and no control flow in the CUDA partition (what CUDA graphs need); the
    control is the CPU graph on the same provider, whose If/Loop put copies in every layer."""
    from specrt.engines.ort_providers import CUDA, placement

    bundle = Bundle.load(gpu_graph_bundles[(form, "fp16")])
    on_cuda = [CUDA, "CPUExecutionProvider"]
    for role in ("draft", "target"):
        graph = bundle.role(role).graph_for("onnxruntime-cuda")
        assert placement(graph, on_cuda) == {"memcpy": 0, "control_flow": 0}
    assert placement(bundle.role("target").graph, on_cuda)["memcpy"] > 0


@needs("onnxruntime-cuda")
@pytest.mark.parametrize("form", ["matmul", "onnx"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_speculation_on_the_gpu_graph_is_its_target_alone(gpu_graph_bundles, form, precision):
    """Greedy speculation on the GPU graph equals that target alone, one request and three
    in one batch; an fp32 GPU graph also scores as the CPU graph."""
    from batch_runs import alone_and_together

    path = gpu_graph_bundles[(form, precision)]
    rt = SpeculativeRuntime.load(path, backend="onnxruntime-cuda", slots=3)
    _greedy_equals_target_alone(rt)
    options = dict(max_new_tokens=32, temperature=0.0, ignore_eos=True, controller="fixed:4")
    requests = [(p, options) for p in [*PROMPTS, "import numpy as np"]]
    alone, together, _ = alone_and_together(rt, requests, slots=3)
    assert together == alone
    if precision == "fp32":
        _close_to_cpu(Bundle.load(path), "onnxruntime-cuda")


@needs("onnxruntime-cuda")
def test_replayed_calls_score_as_plain_ones(gpu_graph_bundles, monkeypatch):
    """A decode and a verify replayed from CUDA graphs give the logits of the same calls run
    plainly, bit for bit, through the calls ONNX Runtime runs before capturing and after."""
    bundle = Bundle.load(gpu_graph_bundles[("matmul", "fp16")])
    replayed = load_engine(bundle, "target", "onnxruntime-cuda")
    monkeypatch.setenv("SPECRT_CUDA_GRAPHS", "0")
    plain = load_engine(bundle, "target", "onnxruntime-cuda")
    assert replayed._graphs is not None and plain._graphs is None
    for engine in (replayed, plain):
        engine.forward(list(range(5, 25)), last=1)
    for step in range(5):
        for tokens in ([30 + step], [31, 32, 33, 34 + step]):
            assert np.array_equal(replayed.forward(tokens), plain.forward(tokens)), step
            replayed.rollback(20)
            plain.rollback(20)
    assert {(0, 1, 1, 1), (0, 1, 4, 4)} <= set(replayed._graphs.shapes)


@pytest.fixture(scope="module")
def trt_bundles(pairs, tmp_path_factory) -> dict:
    from specrt.exporter.build import build_bundle
    from specrt.exporter.tensorrt import TrtOptions

    root = tmp_path_factory.mktemp("trt")
    options = TrtOptions("fp32", 1.0, root / "timing.cache")
    return {
        arch: build_bundle(
            str(draft), str(target), root / arch, max_context=128, tensorrt=options, log=print
        )
        for arch, (draft, target) in pairs.items()
    }


@needs("tensorrt")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensorrt_engine(trt_bundles, arch):
    bundle = Bundle.load(trt_bundles[arch])
    record = bundle.role("target").info["tensorrt"]
    assert record["profiles"] == ["prefill", "decode", "verify"]
    assert record["precision"] == "fp32" and record["tensorrt_version"].startswith("1")
    assert (bundle.path / "target" / record["plan"]).is_file()
    assert (bundle.path.parent / "timing.cache").is_file()
    _close_to_cpu(bundle, "tensorrt")
    _greedy_equals_target_alone(SpeculativeRuntime.load(bundle.path, backend="tensorrt"))


@needs("onnxruntime-tensorrt")
def test_onnxruntime_tensorrt_provider(bundles):
    _close_to_cpu(Bundle.load(bundles["llama"]), "onnxruntime-tensorrt")
