"""The streaming build's parts: weights read one tensor at a time must be the very numbers
transformers loads, and the export check on a part of a model must still catch a wrong graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf_files import write_tiny_gguf

import specrt.exporter.check as check
import specrt.exporter.graph as graph
from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.families import Family
from specrt.exporter.tensors import Subset, open_weights
from specrt.sources import Source, load_model


def _quiet(_: str) -> None:
    pass


def _same_as_transformers(source: Source) -> dict[str, float]:
    """Largest |difference| per tensor between our reader and transformers' loaded model."""
    weights = open_weights(source)
    state = load_model(source).state_dict()
    tied = weights.config.tie_word_embeddings
    names = [n for n in state if not (tied and n == "lm_head.weight")]
    assert sorted(names) == sorted(weights.names())
    return {n: float(np.abs(weights.get(n) - state[n].numpy()).max()) for n in names}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_tensors_are_what_transformers_loads(tmp_path, arch):
    """Names, row order (llama's q/k) and dequantized values, tensor by tensor."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    assert max(_same_as_transformers(Source.parse(str(path))).values()) == 0.0


def test_llama_rows_out_of_order_are_seen(tmp_path, monkeypatch):
    """The control: read in the file's own q/k row order, llama's q/k differ from transformers'."""
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    monkeypatch.setattr(Family, "gguf_interleaved_qk", ())
    diffs = _same_as_transformers(Source.parse(str(path)))
    wrong = {n for n, d in diffs.items() if d > 0}
    assert wrong and all(n.endswith(("q_proj.weight", "k_proj.weight")) for n in wrong)


def test_safetensors_are_what_transformers_loads(pairs):
    assert max(_same_as_transformers(Source.parse(str(pairs["llama"][1]))).values()) == 0.0


def test_rows_bands_and_subsets_read_the_same_numbers(pairs):
    weights = open_weights(Source.parse(str(pairs["llama"][1])))
    embed = weights.get("model.embed_tokens.weight")
    picked = np.array([0, 1, 2, 7, 9, 10, 200])
    assert np.array_equal(weights.rows("model.embed_tokens.weight", picked), embed[picked])
    bands = list(weights.bands("model.embed_tokens.weight", band=100))
    assert np.array_equal(np.concatenate([rows for _, rows in bands]), embed)
    last = weights.config.num_hidden_layers - 1
    subset = Subset(weights, [0, last], picked)
    assert subset.config.num_hidden_layers == 2 and subset.config.vocab_size == len(picked)
    assert subset.config.pad_token_id is None  # an id of the whole vocabulary, not the part
    assert np.array_equal(subset.get("model.embed_tokens.weight"), embed[picked])
    assert np.array_equal(
        subset.get("model.layers.1.mlp.up_proj.weight"),
        weights.get(f"model.layers.{last}.mlp.up_proj.weight"),
    )
    assert "model.layers.2.mlp.up_proj.weight" not in subset


@pytest.fixture
def small_check(monkeypatch):
    """A check budget of a few layers and 64 token ids, so tiny models take the subset path."""
    monkeypatch.setattr(check, "CHECK_BYTES", 380_000)
    monkeypatch.setattr(check, "CHECK_VOCAB", 64)


def test_a_subset_check_covers_first_and_last_layers(pairs, tmp_path, small_check):
    out = build_bundle(None, str(pairs["llama"][1]), tmp_path / "b", log=_quiet)
    role = Bundle.load(out).role("target")
    record, layers = role.info["export_check"], role.dim("num_layers")
    assert record["checked_layers"][-1] == layers - 1 and len(record["checked_layers"]) < layers
    assert record["checked_vocabulary"] < role.dim("vocab_size")
    assert record["max_abs_logit_diff"] <= record["tolerance"]
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert f"target: max|dlogit| on layers {record['checked_layers']} of {layers}" in shown.output


def test_a_subset_check_refuses_a_wrong_graph(pairs, tmp_path, small_check, monkeypatch):
    """The control: a graph without its rotary embedding fails the check on the subset too."""
    monkeypatch.setattr(graph, "_rope", lambda b, x, rotary: x)
    with pytest.raises(SpecrtError, match="differ from PyTorch"):
        build_bundle(None, str(pairs["llama"][1]), tmp_path / "b", log=_quiet)
    assert not (tmp_path / "b").exists()


def test_a_folder_without_safetensors_is_refused_clearly(pairs, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bin"
    model = AutoModelForCausalLM.from_pretrained(pairs["llama"][1])
    model.save_pretrained(folder)
    for path in folder.glob("*.safetensors"):
        torch.save({}, path.with_suffix(".bin"))
        path.unlink()
    with pytest.raises(SpecrtError, match="no .safetensors weights"):
        open_weights(Source.parse(str(folder)))
