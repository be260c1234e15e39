"""benchmarks/gpu_calls.py, the GPU per-call table, run on the CPU: every backend's calls are
timed through the same path a GPU run takes (the exporter's graph in the ONNX Runtime engine,
eager transformers, transformers with a static cache under torch.compile), every row has the
fields a GPU result records, and speculation is priced by replaying the recorded acceptance on
the measured curves. Only the device differs on a GPU (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_calls", ROOT / "benchmarks" / "gpu_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_call_table_runs_its_whole_path_on_the_cpu(tmp_path):
    gpu_calls = _module()
    out = tmp_path / "results" / "gpu-calls"
    arguments = ["--device", "cpu", "--shapes", "tiny", "--pair", "tiny,tiny"]
    arguments += ["--backends", "onnxruntime,torch,torch-compile", "--precisions", "fp32"]
    arguments += ["--prompt", "16", "--widths", "1,3", "--repeat", "2", "--capacity", "128"]
    arguments += ["--compile-backend", "eager", "--cache", str(tmp_path / "cache")]
    arguments += ["--attentions", "in_place,matmul+graphs"]
    result = CliRunner().invoke(gpu_calls.main, [*arguments, "--out", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads(out.with_suffix(".json").read_text())
    assert recorded["gpu"] == "none (CPU run)" and recorded["machine"]["cpu"]
    rows = {gpu_calls.label(row): row for row in recorded["rows"]}
    assert set(rows) == {"onnxruntime", "onnxruntime (matmul+graphs)", "torch", "torch-compile"}
    for backend, row in rows.items():
        assert row["status"] == "ok", row
        assert (row["shape"], row["precision"]) == ("tiny", "fp32")
        assert row["prefill_ms"] > 0 and row["decode_ms"] == row["verify_ms"]["1"] > 0
        assert row["verify_ms"]["3"] > 0
        if backend.startswith("onnxruntime"):  # the engine's batch; PyTorch's hold one row
            assert row["batch8_decode_ms"] > 0
            assert row["row_alone_vs_batch_max"] >= 0 and row["verify5_vs_decodes_max"] >= 0
    priced = {p["backend"]: p for p in recorded["priced"]}
    assert set(priced) == set(rows)
    for entry in priced.values():
        rates = entry["tokens_per_s"]
        assert set(rates) == {f"fixed:{k}" for k in range(9)} | {"adaptive"}
        assert all(rate > 0 for rate in rates.values()) and entry["adaptive_vs_torch_compile"]
    table = out.with_suffix(".md").read_text()
    assert "| tiny | onnxruntime (matmul+graphs) | fp32 |" in table
    assert "| tiny | onnxruntime | fp32 |" in table and "torch.compile's target alone" in table
