"""The GPU paths' pure parts, on CPU: shape profiles, TensorRT call plans, ONNX Runtime TensorRT
provider options, backend diagnosis, and failing fast where TensorRT or a GPU is missing. The
engines themselves run in tests/test_gpu_engines.py, which skips (with its reason) here."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
from click.testing import CliRunner

from specrt import machine
from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.engines import load_engine
from specrt.engines.ort_providers import (
    PROBE_GRAPH,
    check_providers,
    providers_for,
    starts,
    trt_profile_options,
)
from specrt.engines.tensorrt import call_plan
from specrt.errors import SpecrtError
from specrt.profiles import Profile, input_shapes, plan_profiles, select_profile
from specrt.tools.doctor import diagnose, probe
from specrt.tools.gpucheck import torch_sees_a_gpu


def test_profiles_for_the_test_bundles_and_the_default_pair():
    # max_context 128, K_max 8: prompts up to 128 - 8 - 1 = 119 tokens; opt prompt 64,
    # opt context 2 x 64 = 128, opt K 4 -> 5 tokens verified.
    assert plan_profiles(128, 8) == [
        Profile("prefill", 1, 64, 119, 1, 64, 128, 1),
        Profile("decode", 1, 1, 1, 1, 128, 128, 1),
        Profile("verify", 2, 5, 9, 2, 128, 128, 5),
    ]
    # The built-in default: max_context 2048, K_max 8.
    assert plan_profiles(2048, 8) == [
        Profile("prefill", 1, 64, 2039, 1, 64, 2048, 1),
        Profile("decode", 1, 1, 1, 1, 128, 2048, 1),
        Profile("verify", 2, 5, 9, 2, 128, 2048, 5),
    ]
    # Tight limits clamp the opt shapes into range.
    assert plan_profiles(12, 2)[0] == Profile("prefill", 1, 9, 9, 1, 9, 12, 1)
    assert plan_profiles(12, 2)[2] == Profile("verify", 2, 3, 3, 2, 12, 12, 3)
    with pytest.raises(SpecrtError, match="no room"):
        plan_profiles(8, 8)


@pytest.mark.parametrize(
    "new, total, expected",
    [(1, 10, "decode"), (1, 1, "decode"), (5, 50, "verify"), (9, 9, "verify"), (2, 128, "verify")]
    + [(10, 10, "prefill"), (119, 119, "prefill"), (30, 100, "prefill")],
)
def test_select_profile_by_new_tokens(new, total, expected):
    profiles = plan_profiles(128, 8)
    assert profiles[select_profile(profiles, new, total)].name == expected


@pytest.mark.parametrize("new, total", [(120, 120), (1, 129), (9, 130)])
def test_a_call_outside_every_profile_is_a_clear_error(new, total):
    with pytest.raises(SpecrtError, match="fits none of the bundle's profiles"):
        select_profile(plan_profiles(128, 8), new, total)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_input_shapes_and_call_plan_for_the_tiny_models(bundles, arch):
    bundle = Bundle.load(bundles[arch])
    target = bundle.role("target")
    dims = {k: target.dim(k) for k in ("num_layers", "num_kv_heads", "head_dim")}
    assert dims == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16}  # both tiny targets
    verify = plan_profiles(128, 8)[2]
    shapes = input_shapes(verify, capacity=128, **dims)
    assert len(shapes) == 4 + 2 * 4
    assert shapes["input_ids"] == ((1, 2), (1, 5), (1, 9))
    assert shapes["attention_mask"] == ((1, 2), (1, 128), (1, 128))
    assert shapes["past_key_values.3.value"] == ((1, 128, 2, 16),) * 3
    assert shapes["logits_to_keep"] == ((1,),) * 3
    # A batched engine: 1..slots rows, caches of max context + margin, totals into the margin.
    batched = input_shapes(verify, capacity=128, batch=4, margin=64, **dims)
    assert batched["input_ids"] == ((1, 2), (1, 5), (4, 9))
    assert batched["attention_mask"] == ((1, 2), (1, 128), (4, 192))
    assert batched["past_key_values.0.key"] == ((1, 192, 2, 16), (1, 192, 2, 16), (4, 192, 2, 16))

    plan = call_plan(
        bundle_profiles := plan_profiles(128, 8),
        count=5,
        start=20,
        keep=5,
        parity=1,
        capacity=128,
        **dims,
    )
    assert bundle_profiles[plan.profile].name == "verify"
    assert plan.shapes["input_ids"] == plan.shapes["position_ids"] == (1, 5)
    assert plan.shapes["attention_mask"] == (1, 25)
    assert plan.shapes["past_key_values.0.key"] == (1, 128, 2, 16)
    assert plan.positions.tolist() == [20, 21, 22, 23, 24] and (plan.keep, plan.read) == (5, 1)
    prefill = call_plan(bundle_profiles, count=30, start=0, keep=1, parity=0, capacity=128, **dims)
    assert (bundle_profiles[prefill.profile].name, prefill.read) == ("prefill", 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensorrt_provider_options_name_every_dynamic_input(bundles, arch):
    bundle = Bundle.load(bundles[arch])
    options = trt_profile_options(bundle, "draft")  # 2 layers
    entries = {
        key: options[f"trt_profile_{key}_shapes"].split(",") for key in ("min", "opt", "max")
    }
    mins, opts, maxs = entries["min"], entries["opt"], entries["max"]
    # 3 profiles x (ids, positions, mask, logits_to_keep, 2 layers x key/value)
    assert len(mins) == len(opts) == len(maxs) == 3 * (4 + 2 * 2)
    graph_inputs = {i.name for i in load_engine(bundle, "draft").session.get_inputs()}
    for profile in range(3):
        named = {entry.split(":")[0] for entry in maxs[profile * 8 : profile * 8 + 8]}
        assert named == graph_inputs  # every input, each profile
    assert mins[:5] == [
        "input_ids:1x1",
        "position_ids:1x1",
        "attention_mask:1x1",
        "logits_to_keep:1",
        "past_key_values.0.key:1x192x2x16",  # max context 128 + the 64-position margin
    ]
    # The longest prompt leaves room for the longest window: 128 - 32 lookups - 1.
    assert maxs[0] == "input_ids:1x95" and maxs[2] == "attention_mask:1x192"
    # logits_to_keep is a shape tensor: its entries are values. A prefill keeps its last row,
    # a verify call up to the whole window of 32 free drafts + 1.
    assert [maxs[i] for i in (3, 11, 19)] == ["logits_to_keep:1"] * 2 + ["logits_to_keep:33"]
    assert maxs[16] == "input_ids:1x33"
    assert opts[16:20] == [
        "input_ids:1x5",
        "position_ids:1x5",
        "attention_mask:1x128",
        "logits_to_keep:5",
    ]
    batched = trt_profile_options(bundle, "draft", slots=4)["trt_profile_max_shapes"].split(",")
    assert batched[16] == "input_ids:4x33" and batched[20] == "past_key_values.0.key:4x192x2x16"


def test_tensorrt_provider_keeps_a_float32_bundle_in_float32(bundles, monkeypatch):
    """fp16 kernels only for an fp16 graph, and no TF32: a float32 target stays exact. The
    TensorRT provider has no TF32 option; its builder reads NVIDIA_TF32_OVERRIDE, which the
    engine sets for a float32 graph unless the environment already says otherwise."""
    bundle = Bundle.load(bundles["llama"])
    monkeypatch.setattr(
        "onnxruntime.get_available_providers",
        lambda: ["TensorrtExecutionProvider", "CPUExecutionProvider"],
    )
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    (provider, options), *rest = providers_for(bundle, "target", "onnxruntime-tensorrt")
    assert provider == "TensorrtExecutionProvider" and options["trt_fp16_enable"] == "False"
    assert rest == [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")  # the user's own choice stands
    providers_for(bundle, "target", "onnxruntime-tensorrt")
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "1"


def test_the_cuda_provider_runs_float32_without_tf32(bundles, monkeypatch):
    """ONNX Runtime's CUDA provider runs float32 MatMuls in TF32 by default: on an H100 the
    float32 target moved 1.7e-2 from the CPU's logits with it, 9.9e-6 without."""
    monkeypatch.setattr(
        "onnxruntime.get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    providers = providers_for(Bundle.load(bundles["llama"]), "target", "onnxruntime-cuda")
    assert providers == [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    graphs = providers_for(Bundle.load(bundles["llama"]), "target", "onnxruntime-cuda", 1, True)
    assert graphs[0] == ("CUDAExecutionProvider", {"use_tf32": "0", "enable_cuda_graph": "1"})


def test_a_provider_starts_or_says_why_not():
    """`starts` opens a session on a one-node graph: the CPU provider starts; a GPU provider
    this build lacks, or whose libraries cannot load, falls back and is said not to start
    (doctor's verdict: `get_available_providers` lists what is compiled in, not what loads)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    value = {n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy"}
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "probe", [value["x"]], [value["y"]]
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8, producer_name="specrt"
    )
    assert model.SerializeToString() == PROBE_GRAPH
    onnx.checker.check_model(onnx.load_from_string(PROBE_GRAPH))
    assert starts("CPUExecutionProvider") is None
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        assert "does not start" in starts("CUDAExecutionProvider")


def test_a_provider_that_did_not_start_is_refused_not_run_on_the_cpu():
    asked = [("TensorrtExecutionProvider", {}), "CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(SpecrtError, match="could not start TensorrtExecutionProvider.*fell back"):
        check_providers(asked, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(SpecrtError, match="side by side"):
        check_providers(["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"])
    check_providers(
        asked, ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    check_providers(["CPUExecutionProvider"], ["CPUExecutionProvider"])


def test_gpu_backends_refuse_to_fall_back_to_cpu(bundles):
    bundle = Bundle.load(bundles["llama"])
    with pytest.raises(SpecrtError, match="no CUDAExecutionProvider"):
        providers_for(bundle, "target", "onnxruntime-cuda")
    with pytest.raises(SpecrtError, match="no TensorRT engine"):
        load_engine(bundle, "target", "tensorrt")


def test_build_with_tensorrt_fails_fast_and_leaves_nothing(tmp_path):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here: the failure path cannot be shown")
    except ImportError:
        pass
    out = tmp_path / "bundle"
    result = CliRunner().invoke(
        cli,
        ["build", "--draft", "no/such/draft", "--target", "no/such/target", "--out", str(out)]
        + ["--backend", "tensorrt"],
    )
    assert result.exit_code == 1
    assert "TensorRT is not installed" in result.output and "pip install" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_doctor_judges_hand_written_facts():
    cpu_only = {"onnxruntime": "1.31.1", "providers": ["CPUExecutionProvider"], "gpus": []}
    verdicts = {v.backend: v for v in diagnose(cpu_only)}
    assert verdicts["onnxruntime"].ok
    assert not verdicts["onnxruntime-cuda"].ok and "no CUDAExecutionProvider" in (
        verdicts["onnxruntime-cuda"].detail
    )
    assert "TensorRT is not installed" in verdicts["tensorrt"].detail
    assert "specrt[export]" in verdicts["torch"].detail
    gpu = {
        "onnxruntime_gpu": "1.31.1",
        "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
        "gpus": ["NVIDIA H100 80GB HBM3 (sm 9.0)"],
        "tensorrt": "10.16.1",
        "cuda_python": "13.0.0",
        "torch": "2.13.0",
        "transformers": "5.23.0",
    }
    assert all(v.ok for v in diagnose(gpu))
    no_gpu = {**gpu, "gpus": []}
    assert {v.backend for v in diagnose(no_gpu) if not v.ok} == {
        "onnxruntime-cuda",
        "onnxruntime-tensorrt",
        "tensorrt",
    }
    assert "TensorRT 8.6.1 found" in next(
        v.detail for v in diagnose({**gpu, "tensorrt": "8.6.1"}) if v.backend == "tensorrt"
    )
    why = "it does not start (ONNX Runtime fell back to CUDAExecutionProvider, ...)"
    broken = {v.backend: v for v in diagnose({**gpu, "failed": {"TensorrtExecutionProvider": why}})}
    assert not broken["onnxruntime-tensorrt"].ok and why in broken["onnxruntime-tensorrt"].detail
    assert broken["onnxruntime-cuda"].ok


def test_doctor_command_reports_this_machine():
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines()}
    assert set(lines) == {
        "onnxruntime",
        "onnxruntime-cuda",
        "onnxruntime-tensorrt",
        "tensorrt",
        "torch",
        "cpu",
    }
    assert lines["onnxruntime"].split()[1] == "yes"
    assert machine.label(machine.describe()) in lines["cpu"]  # the CPU and its SIMD features


def test_doctor_names_onnxruntime_beside_onnxruntime_gpu_as_the_cause():
    both = {
        "onnxruntime": "1.32.0",
        "onnxruntime_gpu": "1.31.1",
        "providers": ["CPUExecutionProvider"],  # the CPU wheel's files won
        "gpus": ["NVIDIA H200 (sm 9.0)"],
    }
    verdicts = {v.backend: v for v in diagnose(both)}
    assert not verdicts["onnxruntime-cuda"].ok
    assert "both installed" in verdicts["onnxruntime-cuda"].detail
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in verdicts["onnxruntime-cuda"].detail
    working = {**both, "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    cuda = next(v for v in diagnose(working) if v.backend == "onnxruntime-cuda")
    assert cuda.ok and "warning" in cuda.detail


def test_doctor_finds_the_wheels_that_actually_install(monkeypatch):
    """`pip install tensorrt` installs tensorrt-cu13 and its bindings; cuda-python is a shell
    over cuda-bindings: a machine with only the real wheels is still recognised."""
    installed = {"tensorrt-cu13-bindings": "11.4.0.106", "cuda-bindings": "13.5.0"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    facts = probe()
    assert facts["tensorrt"] == "11.4.0.106" and facts["cuda_python"] == "13.5.0"


@pytest.mark.skipif(
    bool(probe()["gpus"]) or torch_sees_a_gpu(), reason="a GPU is here: the check runs for real"
)
def test_gpu_check_without_a_gpu_prints_a_clean_table_and_writes_json(tmp_path):
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(cli, ["doctor", "--gpu-check", str(out)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert lines[0].split()[:3] == ["bundle", "backend", "status"]
    backends = {"torch-cuda", "onnxruntime-cuda", "onnxruntime-tensorrt", "tensorrt"}
    assert {line.split()[1] for line in lines[1:]} == backends
    assert all("no CUDA GPU" in line for line in lines[1:])
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == backends
    assert all(r["status"] == "no CUDA GPU" and r["detail"] for r in rows)
