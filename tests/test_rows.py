"""The row probe: a target's calls are padded to even rows where, and only where, its odd calls
score differently on this machine, and speculation stays exact either way. Which CPU a figure
came from is recorded by name and SIMD features.

The probe's verdict on the real quantized kernels depends on the CPU (see test_precision and
test_gguf, which assert it agrees with a wider measurement); here it runs on targets whose
answer is the same on every machine: a float32 target (invariant) and the odd-rows target (a
float32 graph that adds a vector to the logits of odd calls, see row_checks.py).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrt import machine
from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.engines.onnxruntime import OrtEngine
from specrt.engines.rows import RowProbe
from specrt.runtime import SpeculativeRuntime

PROMPTS = ("def fibonacci(n):", "The quick brown fox")
CONTROLLERS = ("fixed:1", "fixed:3", "heuristic", "adaptive")


def _greedy_differences(runtime: SpeculativeRuntime) -> list[tuple[str, str]]:
    """(prompt, controller) for every speculative output that differs from the target alone."""
    found = []
    for prompt in PROMPTS:
        options = {"max_new_tokens": 30, "ignore_eos": True}
        alone = runtime.generate(prompt, speculate=False, **options)
        for controller in CONTROLLERS:
            spec = runtime.generate(prompt, controller=controller, **options)
            if spec.token_ids != alone.token_ids:
                found.append((prompt, controller))
    return found


def test_a_target_whose_odd_calls_differ_is_padded(odd_rows_bundle):
    engine = OrtEngine.from_bundle(Bundle.load(odd_rows_bundle), "target", threads=1)
    probe = engine.row_probe
    assert engine.even_rows and probe.pads and probe.exact
    assert probe.unpadded > 1 and probe.padded == 0.0
    assert "padded to an even number of rows" in probe.describe()


def test_an_invariant_target_is_not_padded(bundles):
    engine = OrtEngine.from_bundle(Bundle.load(bundles["llama"]), "target", threads=1)
    assert engine.row_probe == RowProbe(0.0) and not engine.even_rows
    assert engine.length == 0  # the probe leaves the cache empty


def test_the_draft_is_not_probed_and_a_caller_may_decide(odd_rows_bundle):
    """Only the target's numbers decide the output; even_rows=True/False skips the probe."""
    bundle = Bundle.load(odd_rows_bundle)
    assert OrtEngine.from_bundle(bundle, "draft").row_probe is None
    for forced in (True, False):
        engine = OrtEngine.from_bundle(bundle, "target", even_rows=forced)
        assert engine.row_probe is None and engine.even_rows is forced


def test_a_padded_target_keeps_speculation_exact(odd_rows_bundle):
    assert _greedy_differences(SpeculativeRuntime.load(odd_rows_bundle, threads=1)) == []


def test_without_padding_speculation_on_that_target_is_not_exact(odd_rows_bundle):
    """The control: verify calls of K+1 rows and one-token decoding disagree unpadded."""
    runtime = SpeculativeRuntime.load(odd_rows_bundle, threads=1, even_rows=False)
    assert _greedy_differences(runtime)


def test_padding_that_does_not_help_is_said():
    probe = RowProbe(0.3, 0.01)
    assert probe.pads and not probe.exact
    assert "may differ from the target alone" in probe.describe()
    assert probe.as_dict()["max_abs_dlogit_padded"] == 0.01


AVX2_BOX = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2
"""
AVX512_BOX = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu avx avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16
"""
ARM_BOX = """processor\t: 0
Features\t: fp asimd asimddp sve i8mm
"""


@pytest.mark.parametrize(
    "text, model, simd",
    [
        (AVX2_BOX, "AMD EPYC 7B13", ["AVX2"]),
        (AVX512_BOX, "AMD EPYC 9B14", ["AVX2", "AVX-512", "AVX512-VNNI", "AVX512-BF16"]),
        (ARM_BOX, None, ["NEON", "DOTPROD", "I8MM", "SVE"]),
    ],
)
def test_cpu_facts_name_the_model_and_its_simd_features(text, model, simd):
    found_model, found_simd = machine.cpu_facts(text)
    assert found_simd == simd
    assert found_model == model or (model is None and found_model)


def test_a_label_names_the_cpu_its_features_and_onnxruntime():
    recorded = {"cpu": "AMD EPYC", "simd": ["AVX2"], "cores": 2, "versions": {"onnxruntime": "1"}}
    assert machine.label(recorded) == "AMD EPYC (AVX2), 2 cores, onnxruntime 1"
    older = {"cpu": "AMD EPYC", "cores": 2}  # results written before SIMD features were recorded
    assert machine.label(older) == "AMD EPYC (SIMD features not recorded), 2 cores"


def test_doctor_shows_each_bundles_row_padding(bundles, odd_rows_bundle):
    args = ["doctor", "--bundle", str(bundles["llama"]), "--bundle", str(odd_rows_bundle)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("target rows")]
    assert "no padding" in rows[0] and "padded to an even number of rows" in rows[1]
    shown = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert [p["pads"] for p in shown["rows"].values()] == [False, True]
    assert shown["machine"]["simd"] == machine.describe()["simd"]
