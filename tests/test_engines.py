"""Exported graphs match PyTorch, and both engines roll back as if rejected tokens never came."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import specrt.engines.onnxruntime as ort_engine
from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.errors import SpecrtError

ARCHS = ("llama", "qwen2")
BACKENDS = ("onnxruntime", "torch")
TOKENS = np.random.default_rng(7).integers(3, 384, 40).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_export_check_is_recorded_and_within_tolerance(bundles, arch):
    manifest = Bundle.load(bundles[arch]).manifest
    for role in ("draft", "target"):
        check = manifest["roles"][role]["export_check"]
        assert set(check["cases"]) == {"prefill_12", "decode_1", "verify_5"}
        assert check["max_abs_logit_diff"] <= check["tolerance"]
        assert check["argmax_agree"]


@pytest.mark.parametrize("arch", ARCHS)
def test_onnx_logits_match_pytorch_for_prefill_decode_and_verify(pairs, bundles, arch):
    engine = load_engine(Bundle.load(bundles[arch]), "target")
    model = AutoModelForCausalLM.from_pretrained(pairs[arch][1]).eval()
    cache = DynamicCache(config=model.config)
    position = 0
    for count in (17, 1, 5):
        new = TOKENS[position : position + count]
        got = engine.forward(new)
        with torch.no_grad():
            want = model(torch.tensor([new]), past_key_values=cache, use_cache=True).logits[0]
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)
        position += count
    assert engine.length == position


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_forgets_rejected_tokens(bundles, arch, backend):
    engine = load_engine(Bundle.load(bundles[arch]), "target", backend)
    engine.forward(TOKENS[:10], last=1)
    engine.forward(TOKENS[10:16])  # six tokens, then "reject" all but two of them
    engine.rollback(12)
    assert engine.length == 12
    after_rollback = engine.forward(TOKENS[20:24])

    engine.reset()
    engine.forward(TOKENS[:12], last=1)
    never_fed = engine.forward(TOKENS[20:24])
    np.testing.assert_allclose(after_rollback, never_fed, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_selects_trailing_logits(bundles, backend):
    engine = load_engine(Bundle.load(bundles["llama"]), "target", backend)
    full = engine.forward(TOKENS[:9])
    engine.reset()
    tail = engine.forward(TOKENS[:9], last=3)
    assert tail.shape == (3, full.shape[1])
    np.testing.assert_allclose(tail, full[-3:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_overflow_and_bad_rollback_are_refused(bundles, backend):
    engine = load_engine(Bundle.load(bundles["llama"]), "target", backend)
    engine.forward(TOKENS[:4])
    with pytest.raises(SpecrtError, match="context full"):
        engine.forward([5] * engine.capacity)
    with pytest.raises(ValueError, match="roll back"):
        engine.rollback(5)


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_accepts_a_batch(pairs, bundles, arch):
    """The runtime decodes one sequence, but the graph's batch dimension is real."""
    import onnxruntime as ort

    role = Bundle.load(bundles[arch]).role("target")
    session = ort.InferenceSession(str(role.graph), providers=["CPUExecutionProvider"])
    shape = role.info["shape"]
    rows = np.array([TOKENS[:6], TOKENS[10:16]])
    cache = np.zeros((2, 16, shape["num_kv_heads"], shape["head_dim"]), np.float32)
    feeds = {
        "input_ids": rows,
        "attention_mask": np.ones((2, 6), np.int64),
        "position_ids": np.tile(np.arange(6), (2, 1)),
        "logits_to_keep": np.array([6]),
    }
    for i in range(shape["num_layers"]):
        feeds[f"past_key_values.{i}.key"] = cache
        feeds[f"past_key_values.{i}.value"] = cache
    batched = session.run(["logits"], feeds)[0]
    model = AutoModelForCausalLM.from_pretrained(pairs[arch][1]).eval()
    with torch.no_grad():
        for b in range(2):
            want = model(torch.tensor(rows[b : b + 1])).logits[0].numpy()
            np.testing.assert_allclose(batched[b], want, atol=1e-4, rtol=0)


def test_export_check_refuses_a_graph_out_of_tolerance(pairs, tmp_path, monkeypatch):
    import specrt.exporter.check as check
    from specrt.exporter.build import build_bundle

    monkeypatch.setattr(check, "RELATIVE_TOLERANCE", 1e-12)  # stricter than float32 can be
    draft, target = pairs["llama"]
    with pytest.raises(SpecrtError, match="exported logits differ from PyTorch by"):
        build_bundle(str(draft), str(target), tmp_path / "b", max_context=64, log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("last", [None, 1, 9])
def test_a_long_row_goes_in_pieces_with_the_logits_of_one_call(bundles, monkeypatch, last):
    """A row longer than PIECE tokens is fed PIECE a call, which bounds the memory of the
    attention's scores; its logits and what its cache holds are the whole call's."""
    engine = load_engine(Bundle.load(bundles["llama"]), "target", "onnxruntime")
    whole = engine.forward(TOKENS, last)
    after = engine.forward([5])
    engine.reset()
    monkeypatch.setattr(ort_engine, "PIECE", 7)
    calls = []
    call = engine._call
    monkeypatch.setattr(engine, "_call", lambda rows, keep: calls.append(rows) or call(rows, keep))
    pieces = engine.forward(TOKENS, last)
    assert [len(tokens) for ((_, tokens),) in calls] == [7] * 5 + [5]
    assert engine.length == len(TOKENS)
    # Bit for bit where the row probe found this machine's calls cut-invariant (as it must
    # for speculation to be exact here); the probe warns where it did not.
    same = np.array_equal if engine.row_probe.exact else _close
    assert same(pieces, whole)
    assert same(engine.forward([5]), after)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.allclose(a, b, atol=1e-4, rtol=0))
