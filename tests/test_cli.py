"""The `specrt` command as a user runs it: real processes, exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def specrt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "specrt.cli", *args], capture_output=True, text=True, timeout=300
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_build_and_inspect(pairs, tmp_path):
    draft, target = pairs["qwen2"]
    out = tmp_path / "bundle"
    built = specrt(
        "build",
        "--draft",
        str(draft),
        "--target",
        str(target),
        "--out",
        str(out),
        "--max-draft",
        "4",
        "--max-context",
        "64",
    )
    assert "[target] checking the graph against PyTorch" in built.stderr  # progress is shown
    shown = specrt("inspect", str(out)).stdout
    assert "K_max 4" in shown and "max context 64" in shown
    assert "files        10 verified against their sha256" in shown
    manifest = json.loads(specrt("inspect", str(out), "--json").stdout)
    assert manifest["max_draft"] == 4


def test_a_gpu_build_from_the_command_line(pairs, tmp_path):
    """--backend onnxruntime-cuda builds and checks the GPU graphs on a machine without a GPU."""
    draft, target = pairs["qwen2"]
    out = tmp_path / "bundle"
    options = ["--max-context", "64", "--backend", "onnxruntime-cuda", "--gpu-attention", "onnx"]
    built = specrt(
        "build", "--draft", str(draft), "--target", str(target), "--out", str(out), *options
    )
    assert "[target] writing the GPU graph (fp16, onnx attention)" in built.stderr
    shown = specrt("inspect", str(out)).stdout
    assert "gpu graph    target gpu/model.onnx: fp16, onnx attention" in shown


def test_inspect_fails_on_a_corrupted_file(bundle_copy):
    (bundle_copy / "draft" / "tokenizer.json").write_text("{}")
    done = specrt("inspect", str(bundle_copy), check=False)
    assert done.returncode == 1
    assert "draft/tokenizer.json does not match its recorded sha256" in done.stderr
    assert "Traceback" not in done.stderr


def test_generate_json_matches_no_speculation(bundles):
    common = [
        "generate",
        str(bundles["llama"]),
        "def add(a, b):",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    spec = json.loads(specrt(*common, "--controller", "fixed:3").stdout)
    alone = json.loads(specrt(*common, "--no-speculation").stdout)
    assert spec["token_ids"] == alone["token_ids"]
    assert alone["stats"]["drafted"] == 0 and spec["stats"]["rounds"] > 0


def test_generate_stream_and_stats(bundles):
    done = specrt(
        "generate",
        str(bundles["qwen2"]),
        "hello",
        "--chat",
        "--stream",
        "--stats",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.7",
        "--seed",
        "3",
    )
    assert "tokens per target call" in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--top-k", "-3"], "top_k must be a whole number"),
        (["--controller", "fixed:99"], "K must be in 0..8"),
    ],
)
def test_generate_rejects_bad_parameters_cleanly(bundles, args, message):
    done = specrt("generate", str(bundles["llama"]), "hi", *args, check=False)
    assert done.returncode == 1
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_bundle_is_a_clear_error(tmp_path):
    done = specrt("generate", str(tmp_path / "nowhere"), "hi", check=False)
    assert done.returncode == 1 and "no such bundle folder" in done.stderr


def test_replay_records_acceptance_once_and_prices_each_controller(bundles, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def fibonacci(n):"}\n{"prompt": "The capital of"}\n')
    traces = tmp_path / "traces.json"
    args = ["replay", str(bundles["qwen2"]), "--prompts", str(prompts), "--max-new-tokens", "24"]
    first = specrt(*args, "--clients", "1,2", "--traces", str(traces))
    assert "recording acceptance on 2 prompts" in first.stderr and traces.exists()
    assert "| clients | fixed:0 |" in first.stdout and "\n| 2 | " in first.stdout
    again = specrt(*args, "--clients", "2", "--traces", str(traces))
    assert "recording" not in again.stderr and "\n| 2 | " in again.stdout
    traces.write_text("[]")
    broken = specrt(*args, "--traces", str(traces), check=False)
    assert broken.returncode == 1 and "not a file of acceptance traces" in broken.stderr
