"""Synthetic checkpoints: real shapes and block types with seeded random weights, readable by
transformers, gguf-py and specrt's build alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf_files import write_tiny_gguf

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.precision import Precision
from specrt.exporter.tensors import open_weights
from specrt.runtime.api import SpeculativeRuntime
from specrt.sources import Source, load_model, load_tokenizer
from specrt.tools.synthetic import CONFIGS, q4_k_m_type, synthesize


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict:
    """A small qwen2-shaped config whose logits are padded past its tokenizer (as Qwen2.5-7B's
    152,064 are past 151,665 tokens), written both ways."""
    root = tmp_path_factory.mktemp("synthetic")
    tokenizer = write_tiny_gguf(root / "tokenizer.gguf")
    vocab = len(load_tokenizer(Source.parse(str(tokenizer))))
    config = {
        **CONFIGS["qwen2.5-7b"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab + 16,
        "max_position_embeddings": 1024,
    }
    made = synthesize("small", root / "out", tokenizer=str(tokenizer), config=config, log=_quiet)
    return {"config": config, "tokenizer": tokenizer, **made}


def test_the_folder_is_what_transformers_loads(synthetic):
    folder = synthetic["safetensors"]
    assert (
        json.loads((folder / "config.json").read_text())["vocab_size"]
        == (synthetic["config"]["vocab_size"])
    )
    source = Source.parse(str(folder))
    state, weights = load_model(source).state_dict(), open_weights(source)
    assert sorted(state) == sorted(weights.names())
    for name in ("model.layers.3.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"):
        assert np.array_equal(weights.get(name), state[name].numpy())
    up = weights.get("model.layers.3.mlp.up_proj.weight")
    assert 0.015 < up.std() < 0.025  # N(0, 0.02), in bf16


def test_the_gguf_follows_the_q4_k_m_recipe(synthetic):
    source = Source.parse(str(synthetic["gguf"]))
    weights = open_weights(source)
    assert weights.kind("lm_head.weight") == "Q6_K"
    assert weights.kind("model.layers.0.self_attn.v_proj.weight") == "Q6_K"
    assert weights.kind("model.layers.2.self_attn.v_proj.weight") == "Q4_K"
    assert weights.kind("model.layers.3.mlp.gate_proj.weight") == "Q4_K"
    assert weights.shape("model.embed_tokens.weight")[0] == synthetic["config"]["vocab_size"]
    state = load_model(source).state_dict()
    assert np.array_equal(weights.get("lm_head.weight"), state["lm_head.weight"].numpy())


def test_q4_k_m_gives_more_bits_where_llama_cpp_does():
    """llama.cpp: the first and last eighth of the layers, and every third one between."""
    more = [i for i in range(28) if q4_k_m_type(f"blk.{i}.ffn_down.weight", 28) == "Q6_K"]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert q4_k_m_type("blk.4.attn_q.weight", 28) == "Q4_K"


@pytest.mark.parametrize("form, precision", [("safetensors", "int4"), ("gguf", "gguf")])
def test_a_synthetic_target_builds_and_runs(synthetic, tmp_path, form, precision):
    out = build_bundle(
        None, str(synthetic[form]), tmp_path / "b", precision={"target": Precision(precision)},
        max_context=256, log=_quiet,
    )  # fmt: skip
    assert Bundle.load(out).role("target").dim("vocab_size") == synthetic["config"]["vocab_size"]
    rt = SpeculativeRuntime.load(out, threads=1)
    prompt = rt.encode("def fibonacci(n):")
    alone = rt.generate(prompt, max_new_tokens=12, ignore_eos=True, speculate=False)
    speculated = rt.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert speculated.token_ids == alone.token_ids


def test_a_gguf_pair_padded_differently_is_exact(synthetic, tmp_path):
    """The synthetic file lists 16 `[PAD<id>]` placeholders past its tokenizer's ids, as
    llama.cpp's converter writes them; the tiny GGUF (the draft) lists none. One tokenizer all
    the same: the pair builds, and greedy speculation is the target alone's output."""
    out = build_bundle(
        str(synthetic["tokenizer"]), str(synthetic["gguf"]), tmp_path / "b",
        precision={"target": Precision("gguf")}, max_context=256, log=_quiet,
    )  # fmt: skip
    bundle = Bundle.load(out)
    assert bundle.role("target").dim("vocab_size") == bundle.role("draft").dim("vocab_size") + 16
    listed = [
        len(load_tokenizer(Source.parse(str(synthetic[k]))).get_vocab())
        for k in ("gguf", "tokenizer")
    ]
    assert listed[0] == listed[1] + 16  # the placeholders are in the file: the rule is needed
    rt = SpeculativeRuntime.load(out, threads=1)
    prompt = rt.encode("The quick brown fox")
    alone = rt.generate(prompt, max_new_tokens=16, ignore_eos=True, speculate=False)
    assert rt.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == alone.token_ids


def test_an_unknown_name_is_refused(tmp_path):
    with pytest.raises(SpecrtError, match="no synthetic config"):
        synthesize("gpt-9", tmp_path / "x", log=_quiet)
