"""Per-role precision: quantized and half-precision graphs build, load and generate; a quantized
draft leaves the output exactly the target's, and a quantized target's output is exactly that
quantized target's own."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from row_checks import CHUNKINGS, cuts_differ, this_machine

from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.engines.onnxruntime import OrtEngine
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.precision import Precision
from specrt.runtime import SpeculativeRuntime

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "User: What is the capital"]
CONTROLLERS = ["fixed:1", "fixed:4", "adaptive"]


@pytest.fixture(scope="module")
def quantized(precision_bundles) -> dict:
    return {
        name: SpeculativeRuntime.load(path, threads=1) for name, path in precision_bundles.items()
    }


@pytest.mark.parametrize("name", ["d-int4_t-fp32", "d-int8_t-int4", "d-fp16_t-int8"])
def test_greedy_equals_the_same_target_alone(quantized, name):
    rt = quantized[name]
    assert rt.bundle.precision_label == name
    accepted = 0
    for prompt in PROMPTS:
        alone = rt.generate(prompt, max_new_tokens=40, speculate=False, ignore_eos=True)
        for controller in CONTROLLERS:
            spec = rt.generate(prompt, max_new_tokens=40, controller=controller, ignore_eos=True)
            assert spec.token_ids == alone.token_ids, (prompt, controller)
            accepted += spec.stats.accepted
    assert accepted > 0


def test_a_quantized_draft_changes_acceptance_not_output(quantized, bundles):
    """int4 draft + float32 target gives exactly the float32 bundle's target-alone tokens."""
    float32 = SpeculativeRuntime.load(bundles["qwen2"], threads=1)
    mixed = quantized["d-int4_t-fp32"]
    for prompt in PROMPTS:
        want = float32.generate(prompt, max_new_tokens=40, speculate=False, ignore_eos=True)
        got = mixed.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert got.token_ids == want.token_ids


def test_graphs_and_manifest_record_what_each_role_runs(quantized):
    bundle = quantized["d-int4_t-fp32"].bundle
    draft = bundle.role("draft")
    graph = onnx.load(str(draft.graph), load_external_data=False)
    ops = {node.op_type for node in graph.graph.node}
    assert "MatMulNBits" in ops and "Gemm" not in ops  # the tied head was untied and quantized
    gathers = [n for n in graph.graph.node if n.op_type == "Gather"]
    assert any(n.input[0] == "embed_tokens.weight" for n in gathers)  # embedding kept float32
    assert draft.info["precision"]["weights"] == "int4"
    assert draft.info["precision"]["block_size"] == 128
    check = draft.info["export_check"]
    assert check["max_abs_logit_diff"] <= check["tolerance"]  # float32 graph checked first
    assert 0 < check["top1_agreement_vs_float32"] <= 1  # on the prose sample, not random ids
    assert check["kl_mean_vs_float32"] >= 0 and check["sample_tokens"] == 127
    assert bundle.role("target").info["precision"] == {"weights": "fp32"}
    half = quantized["d-fp16_t-int8"].bundle.role("draft")
    inputs = onnx.load(str(half.graph), load_external_data=False).graph.input
    cache = next(i for i in inputs if i.name == "past_key_values.0.key")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_inspect_says_what_outputs_are_exact_against(quantized):
    runner = CliRunner()
    mixed = runner.invoke(cli, ["inspect", str(quantized["d-int4_t-fp32"].bundle.path)])
    assert mixed.exit_code == 0, mixed.output
    assert "draft int4 (MatMulNBits, block 128" in mixed.output
    assert "exact against the float32 target" in mixed.output
    both = runner.invoke(cli, ["inspect", str(quantized["d-int8_t-int4"].bundle.path)])
    assert "exact against the int4 target, not float32" in both.output
    listing = runner.invoke(cli, ["inspect", "--json", str(quantized["d-int8_t-int4"].bundle.path)])
    manifest = json.loads(listing.output)
    assert manifest["roles"]["target"]["precision"]["weights"] == "int4"


@pytest.mark.parametrize(
    "args, message",
    [
        ({"weights": "int3"}, "not one of fp32, fp16, int8, int4"),
        ({"weights": "int4", "block_size": 48}, "power of two"),
        ({"weights": "int4", "accuracy_level": 7}, "accuracy level"),
    ],
)
def test_bad_precision_is_a_clear_error(args, message):
    with pytest.raises(SpecrtError, match=message):
        Precision(**args)


def test_build_refuses_a_bad_precision_before_exporting(pairs, tmp_path):
    draft, target = pairs["llama"]
    result = CliRunner().invoke(
        cli,
        ["build", "--draft", str(draft), "--target", str(target), "--out", str(tmp_path / "b")]
        + ["--target-precision", "int2"],
    )
    assert result.exit_code == 1
    assert "precision 'int2' is not one of" in result.output
    assert not (tmp_path / "b").exists()


def test_build_cli_passes_precision_options(pairs, tmp_path):
    draft, target = pairs["llama"]
    out = tmp_path / "b"
    result = CliRunner().invoke(
        cli,
        ["build", "--draft", str(draft), "--target", str(target), "--out", str(out)]
        + ["--draft-precision", "int8", "--block-size", "32", "--accuracy-level", "1"]
        + ["--max-context", "64"],
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    draft_precision = manifest["roles"]["draft"]["precision"]
    assert (draft_precision["weights"], draft_precision["block_size"]) == ("int8", 32)
    assert draft_precision["accuracy_level"] == 1
    assert manifest["roles"]["target"]["precision"] == {"weights": "fp32"}


@pytest.mark.parametrize(
    "name",
    ["float32", "d-int4_t-fp32", "d-int8_t-int4", "d-fp16_t-int8", "odd-rows", "half-cache"],
)
def test_target_logits_do_not_depend_on_how_calls_are_cut(
    bundles, precision_bundles, odd_rows_bundle, half_cache_bundle, name
):
    """What makes verify-K+1 equal to decoding one by one, bit for bit, at every precision
    and cache type, with the padding the engine probed for."""
    paths = {"float32": bundles["llama"], **precision_bundles, "odd-rows": odd_rows_bundle}
    paths["half-cache"] = half_cache_bundle
    engine = OrtEngine.from_bundle(Bundle.load(paths[name]), "target", threads=1)
    assert cuts_differ(engine) == []


def test_without_padding_a_target_whose_odd_calls_differ_depends_on_the_cut(odd_rows_bundle):
    """The control for the test above, on every machine: unpadded, every cut with an odd call
    differs from the whole."""
    engine = OrtEngine.from_bundle(Bundle.load(odd_rows_bundle), "target", even_rows=False)
    assert cuts_differ(engine) == list(CHUNKINGS)


@pytest.mark.parametrize("name", ["d-int8_t-int4", "d-fp16_t-int8"])
def test_the_row_probe_agrees_with_the_cuts(precision_bundles, name):
    """Whether MatMulNBits' odd calls differ depends on the CPU (on AVX2 they do; on AVX-512/
    VNNI not for every form): the probe's verdict at load must be what a wider measurement of
    the unpadded target finds, and padding must leave no difference either way."""
    bundle = Bundle.load(precision_bundles[name])
    probe = OrtEngine.from_bundle(bundle, "target", threads=1).row_probe
    differ = cuts_differ(OrtEngine.from_bundle(bundle, "target", threads=1, even_rows=False))
    found = f"on {this_machine()}: the probe found {probe.describe()}; cuts that differ: {differ}"
    assert probe.pads == bool(differ), found
    assert probe.exact, found


def test_an_fp16_target_is_refused_on_cpu(pairs, tmp_path):
    draft, target = pairs["qwen2"]
    path = build_bundle(
        str(draft),
        str(target),
        tmp_path / "b",
        max_context=64,
        precision={"target": Precision("fp16")},
        log=lambda _: None,
    )
    with pytest.raises(SpecrtError, match="the target is fp16, which is meant for GPU providers"):
        SpeculativeRuntime.load(path)


def test_a_half_size_cache_is_exact_against_its_own_target(half_cache_bundle, precision_bundles):
    """float16 keys and values: half the bytes a position, speculation exactly the same
    target alone, and a model a little apart from the float32 cache's (the control: the
    same int4 target keeping float32 gives other logits, close ones)."""
    rt = SpeculativeRuntime.load(half_cache_bundle, threads=1)
    same = SpeculativeRuntime.load(precision_bundles["d-int8_t-int4"], threads=1)
    assert rt.target._cache_type == np.float16 and same.target._cache_type == np.float32
    assert 2 * rt.target.position_bytes == same.target.position_bytes
    for prompt in PROMPTS:
        alone = rt.generate(prompt, max_new_tokens=40, speculate=False, ignore_eos=True)
        for controller in CONTROLLERS:
            spec = rt.generate(prompt, max_new_tokens=40, controller=controller, ignore_eos=True)
            assert spec.token_ids == alone.token_ids, (prompt, controller)
    ids = rt.encode(PROMPTS[0])
    rt.target.reset()
    same.target.reset()
    half, full = rt.target.forward(ids), same.target.forward(ids)
    assert 0 < np.abs(half - full).max() < 0.05 * np.abs(full).max()


def test_a_half_size_cache_is_recorded_checked_and_shown(half_cache_bundle):
    bundle = Bundle.load(half_cache_bundle)
    target = bundle.role("target")
    assert target.kv_cache == "float16" and target.info["precision"]["cache"] == "float16"
    inputs = onnx.load(str(target.graph), load_external_data=False).graph.input
    cache = next(i for i in inputs if i.name == "past_key_values.0.key")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert target.info["export_check"]["kl_mean_vs_float32"] >= 0  # checked as a conversion
    shown = CliRunner().invoke(cli, ["inspect", str(half_cache_bundle)])
    assert "keys and values kept in float16" in shown.output
    assert "exact against the int4 target with its float16 cache" in shown.output


def test_a_bad_cache_type_is_a_clear_error(pairs, tmp_path):
    with pytest.raises(SpecrtError, match="KV cache type 'int8' is not one of float32, float16"):
        Precision("fp32", cache="int8")
    draft, target = pairs["llama"]
    args = ["build", "--draft", str(draft), "--target", str(target), "--out", str(tmp_path / "b")]
    refused = CliRunner().invoke(cli, [*args, "--kv-cache", "bfloat16"])
    assert refused.exit_code == 2 and "--kv-cache" in refused.output
