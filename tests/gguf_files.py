"""Tiny GGUF files for tests: a real tokenizer, random weights in the quantized types the
registry's models hold (and a few more), loadable by transformers like any GGUF.

There is no model hub here and gguf-py cannot quantize K-quants, so the blocks are random bytes
with a sane scale: every bit pattern of the packed scales and values gets exercised, which is
what an exactness test of the unpacking wants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specrt.exporter.tiny import train_tokenizer
from specrt.tools.synthetic import random_blocks

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# Per projection: the registry's target holds Q4_K and Q6_K, its draft Q5_0, Q8_0, Q6_K, Q4_K.
TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q5_0",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q5_K",
    "ffn_down": "Q4_1",
    "output": "Q6_K",
    "token_embd": "Q5_1",
}


def write_tiny_gguf(path: Path, arch: str = "qwen2", seed: int = 0, types=None) -> Path:
    import gguf

    types = {**TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    tokenizer = train_tokenizer()
    vocab = len(tokenizer)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(writer, tokenizer)

    def quantized(name: str, rows: int, inputs: int) -> None:
        kind = types[name.split(".")[-2]]
        if kind == "F16":
            writer.add_tensor(name, rng.normal(0, 0.05, (rows, inputs)).astype(np.float16))
            return
        writer.add_tensor(
            name,
            random_blocks(kind, rows, inputs, rng),
            raw_dtype=getattr(gguf.GGMLQuantizationType, kind),
        )

    def floats(name: str, *shape: int) -> None:
        writer.add_tensor(
            name, rng.normal(1.0 if len(shape) == 1 else 0.0, 0.05, shape).astype(np.float32)
        )

    quantized("token_embd.weight", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        floats(f"blk.{i}.attn_norm.weight", HIDDEN)
        quantized(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        quantized(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            for part, rows in (
                ("q", HIDDEN),
                ("k", KV_HEADS * head_dim),
                ("v", KV_HEADS * head_dim),
            ):
                writer.add_tensor(
                    f"blk.{i}.attn_{part}.bias", rng.normal(0, 0.05, rows).astype(np.float32)
                )
        quantized(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        floats(f"blk.{i}.ffn_norm.weight", HIDDEN)
        quantized(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        quantized(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        quantized(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    floats("output_norm.weight", HIDDEN)
    quantized("output.weight", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer) -> None:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens) | {t["content"] for t in state["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])
    merges = state["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_chat_template(tokenizer.chat_template)
