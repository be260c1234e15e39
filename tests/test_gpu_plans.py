"""The GPU paths' pure parts, on CPU: shape profiles, TensorRT call plans, ONNX Runtime TensorRT
provider options, backend diagnosis, and failing fast where TensorRT or a GPU is missing. The
engines themselves run in tests/test_gpu_engines.py, which skips (with its reason) here."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.doctor import diagnose
from specrt.engines import load_engine
from specrt.engines.onnxruntime import providers_for, trt_profile_options
from specrt.engines.tensorrt import call_plan
from specrt.errors import SpecrtError
from specrt.profiles import Profile, input_shapes, plan_profiles, select_profile


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
    assert shapes["past_key_values.3.value"] == ((1, 2, 128, 16),) * 3
    assert shapes["logits_to_keep"] == ((1,),) * 3

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
    assert plan.shapes["past_key_values.0.key"] == (1, 2, 128, 16)
    assert (plan.position_offset, plan.keep, plan.read) == (20 * 8, 5, 1)
    prefill = call_plan(bundle_profiles, count=30, start=0, keep=1, parity=0, capacity=128, **dims)
    assert (bundle_profiles[prefill.profile].name, prefill.read) == ("prefill", 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensorrt_provider_options_list_every_profile(bundles, arch):
    options = trt_profile_options(Bundle.load(bundles[arch]), "draft")  # 2 layers
    mins = options["trt_profile_min_shapes"].split(",")
    maxs = options["trt_profile_max_shapes"].split(",")
    assert len(mins) == len(maxs) == 3 * (3 + 2 * 2)  # 3 profiles x (ids, positions, mask, cache)
    assert mins[:4] == [
        "input_ids:1x1",
        "position_ids:1x1",
        "attention_mask:1x1",
        "past_key_values.0.key:1x2x128x16",
    ]
    # The longest prompt leaves room for the longest window: 128 - 32 lookups - 1.
    assert maxs[0] == "input_ids:1x95" and maxs[2] == "attention_mask:1x128"
    assert maxs[14] == "input_ids:1x33"  # the verify profile takes 32 free drafts
    verify = options["trt_profile_opt_shapes"].split(",")[14:17]
    assert verify == ["input_ids:1x5", "position_ids:1x5", "attention_mask:1x128"]


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
    }
    assert lines["onnxruntime"].split()[1] == "yes"
