"""`specrt bench` on a tiny bundle: every configuration runs and the report is complete."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specrt import machine
from specrt.runtime.sequence import per_token_latencies
from specrt.tools.bench import run_bench
from specrt.tools.prompts import load_prompts
from specrt.tools.report import write_report

PROMPT_FILES = [
    Path(__file__).parent.parent / "benchmarks" / "prompts" / f"{name}.jsonl"
    for name in ("chat", "code")
]
NAMES = [
    "pytorch_baseline",
    "hf_assisted",
    "specrt_target_only",
    "specrt_fixed_2",
    "specrt_adaptive",
]


def test_bench_writes_json_markdown_and_chart(bundles, tmp_path):
    prompts = load_prompts(PROMPT_FILES)[::3]  # a few code and chat prompts
    assert {p["set"] for p in prompts} == {"code", "chat"}
    only = [*NAMES, "ort_genai"]  # skipped with a note: no GenAI model is given here
    result = run_bench(bundles["llama"], prompts, max_new_tokens=6, only=only, log=lambda _: None)
    rows = {row["name"]: row for row in result["configs"]}
    assert list(rows) == NAMES
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["speedup_vs_pytorch"] > 0
        assert row["new_tokens"] == 6 * len(prompts)
        assert isinstance(row["identical_to_baseline"], bool)
    assert rows["pytorch_baseline"]["speedup_vs_pytorch"] == 1.0
    assert rows["hf_assisted"]["identical_to_baseline"]  # transformers against itself
    assert rows["specrt_fixed_2"]["identical_to_target_alone"]
    assert rows["specrt_adaptive"]["identical_to_target_alone"]
    assert any(note.startswith("ort_genai skipped") for note in result["notes"])
    assert result["machine"]["cpu"] and isinstance(result["machine"]["simd"], list)
    assert "onnxruntime" in result["machine"]["versions"]
    assert result["row_padding"]["d-fp32_t-fp32"]["pads"] is False  # float32: rows invariant

    paths = write_report(result, tmp_path, "tiny")
    assert [p.name for p in paths] == ["tiny.json", "tiny.md", "tiny.png"]
    assert json.loads(paths[0].read_text())["configs"][0]["name"] == "pytorch_baseline"
    table = paths[1].read_text()
    assert "| specrt_adaptive |" in table and machine.label(result["machine"]) in table
    assert "Target rows (probed at load)" in table
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_precision_combinations_side_by_side(bundles, precision_bundles, tmp_path):
    prompts = load_prompts(PROMPT_FILES)[:2]
    mixed = "d-int4_t-fp32"
    only = ["specrt_target_only", "specrt_adaptive", f"specrt_target_only_{mixed}"]
    only += [f"specrt_adaptive_{mixed}", "ort_genai_int4"]
    result = run_bench(
        [bundles["qwen2"], precision_bundles[mixed]],
        prompts,
        max_new_tokens=8,
        only=only,
        genai_models={"int4": None},
        log=lambda _: None,
    )
    rows = {row["name"]: row for row in result["configs"]}
    assert list(rows) == only[:4]
    assert rows[f"specrt_adaptive_{mixed}"]["exact_against"] == f"specrt_target_only_{mixed}"
    assert all(row["identical_to_target_alone"] for row in rows.values())
    assert all(row["rss_mb"] > 0 for row in rows.values()) and result["peak_rss_mb"] > 0
    assert result["settings"]["precisions"] == ["d-fp32_t-fp32", mixed]
    curve = result["costs"][mixed]["verify_ratio"]
    # K = 0..16, then windows out to the bundle's lookup window (32 drafts: 33 tokens)
    assert sorted(curve) == [*range(1, 18), 24, 33] and curve[1] == 1.0
    assert any(note.startswith("ort_genai_int4 skipped") for note in result["notes"])
    quality = result["quality"][mixed]
    assert quality["target"] == {"precision": "fp32"}  # the reference itself
    assert quality["draft"]["precision"] == "int4" and quality["draft"]["kl_mean_vs_float32"] > 0
    markdown = write_report(result, tmp_path, "mixed")[1].read_text()
    assert f"| specrt_adaptive_{mixed} |" in markdown
    assert f"| {mixed} |" in markdown  # the verify-cost table
    assert f"| {mixed} | draft | int4 | " in markdown  # its quality against float32

    lines = []
    with pytest.MonkeyPatch.context() as patch:  # as without the bench extra
        patch.setitem(sys.modules, "matplotlib", None)
        paths = write_report(result, tmp_path / "plain", "mixed", log=lines.append)
    assert [p.name for p in paths] == ["mixed.json", "mixed.md"]
    assert lines == ["chart skipped: matplotlib is not installed (pip install 'specrt[bench]')"]


def test_per_token_latency_spreads_a_block_over_its_tokens():
    # first token at 1.0 s; then a block of 3 at 1.6 s; then a single token at 1.8 s
    got = per_token_latencies([1.0, 1.6, 1.6, 1.6, 1.8], ttft=1.0)
    assert got == pytest.approx([0.2, 0.2, 0.2, 0.2])


def test_spec_bench_prompts_by_category(tmp_path):
    """Spec-Bench's question.jsonl: the first turn becomes a chat message; --categories and
    --per-category pick a subset."""
    lines = [
        {"question_id": i, "category": cat, "turns": [f"{cat} question {i}", "a second turn"]}
        for i, cat in enumerate(["writing", "rag", "rag", "summarization", "rag"])
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    prompts = load_prompts([path], categories=["rag", "summarization"], per_category=2)
    assert [p["category"] for p in prompts] == ["rag", "rag", "summarization"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "rag question 1"}]
    assert {p["category"] for p in load_prompts(PROMPT_FILES)} == {"code", "chat"}


def test_bench_reports_lookup_rows_per_category(bundles, tmp_path):
    prompts = [
        {**p, "category": cat}
        for p, cat in zip(load_prompts(PROMPT_FILES)[:2], ["edit", "rag"], strict=True)
    ]
    only = ["specrt_target_only", "specrt_ngram", "specrt_hybrid"]
    result = run_bench(
        bundles["llama"], prompts, max_new_tokens=6, only=only, stop_at_eos=True, log=print
    )
    assert result["settings"]["stop_at_eos"]
    rows = {row["name"]: row for row in result["configs"]}
    assert list(rows) == only
    for row in rows.values():
        assert row["identical_to_target_alone"]
        assert row["decode_tokens_per_s"] > 0
        assert set(row["categories"]) == {"edit", "rag"}
        assert all(c["speedup_vs_target_alone"] > 0 for c in row["categories"].values())
    assert rows["specrt_target_only"]["speedup_vs_target_alone"] == 1.0
    assert "Per category" in write_report(result, tmp_path, "cat")[1].read_text()


def test_the_load_benchmark_reports_every_config_at_every_concurrency(
    precision_bundles, tmp_path, monkeypatch
):
    """`specrt bench --concurrency` on a tiny int4 target: every configuration at every level,
    with the figures the results file promises, and every output equal to its run alone. Each
    run starts from the costs calibrated at load, not from what the run before it timed;
    adaptive's entries keep each request's course round by round (K, kept, reason)."""
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.tools import concurrency

    starts, real = [], concurrency.run_level

    def run_level(rt, *args):
        starts.append((rt.costs.rounds, rt.costs.drift))
        return real(rt, *args)

    monkeypatch.setattr(concurrency, "run_level", run_level)
    bundle = precision_bundles["d-int8_t-int4"]
    args = ["bench", str(bundle), "--concurrency", "1,3", "--max-new-tokens", "6", "--repeat", "2"]
    args += ["--prompts", str(PROMPT_FILES[0]), "--out", str(tmp_path), "--name", "load"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "load.json").read_text())
    entries = report["configs"]
    names = ["target_only", "fixed_1", "fixed_2", "fixed_4", "adaptive"]
    assert [(e["name"], e["concurrency"]) for e in entries] == [
        (f"{name}_d-int8_t-int4", level) for name in names for level in (1, 3)
    ]
    for entry in entries:
        assert entry["identical_to_alone"] and entry["aggregate_tokens_per_s"] > 0
        assert len(entry["aggregate_runs"]) == 2  # the median of two runs is reported
        assert entry["aggregate_tokens_per_s"] in entry["aggregate_runs"]
        assert entry["requests"] == max(4, 2 * entry["concurrency"])
        assert entry["tokens"] == 6 * entry["requests"]
    assert next(e for e in entries if e["name"].startswith("target_only"))["mean_k"] == 0
    for entry in entries:  # adaptive's course round by round in every run, and no one else's
        runs = entry.get("by_request_runs", [])
        assert "by_request" not in entry
        assert len(runs) == (2 if entry["config"] == "adaptive" else 0)
        for request in (request for run in runs for request in run):
            ks = request["k_by_round"]
            assert len(request["kept_by_round"]) == len(ks) > 0
            turned = {str(i) for i in range(1, len(ks)) if ks[i] != ks[i - 1]}
            assert {"0", *turned} <= set(request["why"]) <= set(map(str, range(len(ks))))
    assert {g["concurrency"] for g in report["goals"]} == {1, 3}
    assert "| adaptive_d-int8_t-int4 |" in (tmp_path / "load.md").read_text()
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
    assert starts == [(0, (1.0, 1.0))] * (2 * 2 * len(names))  # calibration's: no call timed since


def test_the_load_benchmark_refuses_bad_levels(bundles, tmp_path):
    from click.testing import CliRunner

    from specrt.cli import cli

    for levels in ("1,x", "0,2"):
        args = ["bench", str(bundles["llama"]), "--concurrency", levels, "--out", str(tmp_path)]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0 and "--concurrency" in result.output
