"""Synthetic checkpoints: a real model's config and tokenizer with seeded random weights.

No 7-8B weights ship as packages here, yet what a build costs (time, peak memory) and how fast a
target runs depend on the shapes and the block types, not on the values. A synthetic checkpoint
has the real shapes: written as a Hugging Face folder (config.json, the tokenizer, bf16
safetensors, as the hub ships them) and as a GGUF file whose blocks follow llama.cpp's Q4_K_M
recipe (Q6_K head and, in some layers, attn_v/ffn_down; Q4_K elsewhere), with random but valid
blocks. Both are written one tensor at a time, so a 7B checkpoint needs no 15 GB of memory.
Outputs are meaningless text; use them for sizes and speeds only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.gguf_blocks import K_TYPE_SIZES, TYPE_SIZES

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "_qkv_bias": True,  # Qwen2's q/k/v projections carry biases (not a config.json field)
}
# The published configs (config.json) of the models people pair; vocab_size is the model's
# padded logit count, not the tokenizer's length.
CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        **_QWEN2,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN2,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN2,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
}
# The tokenizer at hand for each family (a registry name): Qwen2.5's own; no Llama 3 tokenizer
# ships here, so the llama configs take SmolLM2's (a smaller vocabulary inside the padded one).
TOKENIZERS = {"qwen2": "qwen2.5-coder-0.5b-instruct", "llama": "smollm2-135m-instruct"}
# Where each block type keeps its f16 scale(s), and the largest |integer factor| it multiplies:
# random bytes with such a scale are valid blocks of weights about `magnitude` in size.
SCALE_AT = {
    "Q4_0": ([0], 8),
    "Q4_1": ([0, 2], 15),
    "Q5_0": ([0], 16),
    "Q5_1": ([0, 2], 31),
    "Q8_0": ([0], 128),
    "Q4_K": ([0, 2], 63 * 15),
    "Q5_K": ([0, 2], 63 * 31),
    "Q6_K": ([208], 128 * 32),
    "Q2_K": ([80, 82], 15 * 3),
    "Q3_K": ([108], 32 * 4),
    "IQ4_NL": ([0], 127),
    "IQ4_XS": ([0], 32 * 127),
    "IQ2_XXS": ([0], 43 * 4),
}
BLOCK_BYTES = {**TYPE_SIZES, **K_TYPE_SIZES, "IQ2_XXS": 66}
STD = 0.02  # the initializer range of these families
BAND = 4096  # rows made at a time
Log = Callable[[str], None]


def random_blocks(kind: str, rows: int, inputs: int, rng, magnitude: float = 0.1) -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks whose weights stay within about magnitude."""
    per = 32 if kind in TYPE_SIZES else 256
    raw = rng.integers(0, 256, (rows, inputs // per, BLOCK_BYTES[kind]), dtype=np.uint8)
    positions, factor = SCALE_AT[kind]
    for at in positions:
        d = rng.uniform(0.5, 1.0, (rows, inputs // per, 1)) * magnitude / factor
        raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every weight, in the order the hub's files list them."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    yield "model.embed_tokens.weight", (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        yield f"{layer}.input_layernorm.weight", (hidden,)
        for part, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            yield f"{layer}.self_attn.{part}_proj.weight", (rows, hidden)
            if config.get("_qkv_bias"):
                yield f"{layer}.self_attn.{part}_proj.bias", (rows,)
        yield f"{layer}.self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield f"{layer}.post_attention_layernorm.weight", (hidden,)
        yield f"{layer}.mlp.gate_proj.weight", (inner, hidden)
        yield f"{layer}.mlp.up_proj.weight", (inner, hidden)
        yield f"{layer}.mlp.down_proj.weight", (hidden, inner)
    yield "model.norm.weight", (hidden,)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (config["vocab_size"], hidden)


def _values(name: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """float32 values: norms 1, biases and matrices N(0, STD)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(STD)


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even as PyTorch does."""
    bits = values.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return (rounded >> 16).astype(np.uint16)


def write_safetensors(config: dict, path: Path, seed: int, log: Log) -> None:
    """model.safetensors in bf16, header first and then each tensor as it is made (the
    safetensors format is an 8-byte header length, a JSON header and the raw bytes; its own
    writer needs every tensor in memory at once)."""
    shapes = list(tensor_shapes(config))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        size = 2 * int(np.prod(shape))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes:
            for start in range(0, shape[0], BAND):  # a band of rows at a time: bounded memory
                band = (min(BAND, shape[0] - start), *shape[1:])
                handle.write(_bfloat16(_values(name, band, rng)).tobytes())
            if name.endswith("down_proj.weight"):
                log(f"  layer {name.split('.')[2]} of {config['num_hidden_layers']} written")


def q4_k_m_type(name: str, layers: int) -> str:
    """The block type llama.cpp's Q4_K_M recipe gives a GGUF tensor."""
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        more_bits = (
            layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        )
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def write_gguf(config: dict, path: Path, tokenizer_gguf: Path, seed: int, log: Log) -> None:
    """A Q4_K_M-like GGUF: header and tensor infos first, then each tensor as it is made."""
    import gguf

    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    writer.add_name(f"synthetic {config['_name']}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _copy_tokenizer(tokenizer_gguf, writer, config["vocab_size"])
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    plan = []
    for hf_name, shape in tensor_shapes(config):
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        kind = "F32" if len(shape) == 1 else q4_k_m_type(name, layers)
        plan.append((name, shape, kind))
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            per = 256 if kind in K_TYPE_SIZES else 32
            nbytes = shape[0] * shape[1] // per * BLOCK_BYTES[kind]
            raw = getattr(gguf.GGMLQuantizationType, kind)
            writer.add_tensor_info(
                name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=raw
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind in plan:
        if kind == "F32":
            writer.write_tensor_data(_values(name, shape, rng))
        else:
            writer.write_tensor_data(random_blocks(kind, shape[0], shape[1], rng, magnitude=0.05))
        if name.endswith("ffn_down.weight"):
            log(f"  layer {name.split('.')[1]} of {layers} written")
    writer.close()


def _copy_tokenizer(source: Path, writer, vocab_size: int) -> None:
    """The tokenizer.* metadata of a GGUF file, its token list padded to the model's logits
    with unused [PAD] tokens as llama.cpp's converter does (e.g. Qwen2.5-7B: 152,064)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value[:vocab_size] + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
        elif key == "tokenizer.ggml.token_type":
            value = value[:vocab_size] + [5] * (vocab_size - len(value))  # 5: unused
        elif key == "tokenizer.ggml.scores":
            value = value[:vocab_size] + [0.0] * (vocab_size - len(value))
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])


def synthesize(
    name: str,
    out: Path,
    *,
    formats: tuple[str, ...] = ("safetensors", "gguf"),
    tokenizer: str | None = None,
    seed: int = 0,
    config: dict | None = None,
    log: Log = print,
) -> dict[str, Path]:
    """Write the synthetic `name` (a CONFIGS entry, or `config` under that name) under out: a
    Hugging Face folder `hf/` and/or a GGUF file. The tokenizer comes from `tokenizer` (a GGUF
    file or registry name; by default the family's one at hand, see TOKENIZERS)."""
    from specrt.files import atomic_dir
    from specrt.sources import Source, load_tokenizer

    if config is None and name not in CONFIGS:
        raise SpecrtError(f"no synthetic config {name!r}; known: {', '.join(CONFIGS)}")
    config = {**(config or CONFIGS[name]), "_name": name}
    source = Source.parse(tokenizer or TOKENIZERS[config["model_type"]])
    if source.kind != "gguf":
        raise SpecrtError(f"{source.spec}: the tokenizer must come from a GGUF file")
    made = {}
    with atomic_dir(Path(out)) as tmp:
        if "safetensors" in formats:
            folder = tmp / "hf"
            folder.mkdir()
            public = {k: v for k, v in config.items() if not k.startswith("_")}
            (folder / "config.json").write_text(json.dumps(public, indent=2))
            load_tokenizer(source).save_pretrained(folder)
            log(f"writing {name} as bf16 safetensors")
            write_safetensors(config, folder / "model.safetensors", seed, log)
            made["safetensors"] = Path(out) / "hf"
        if "gguf" in formats:
            log(f"writing {name} as a Q4_K_M-like GGUF")
            write_gguf(config, tmp / f"{name}-q4_k_m.gguf", Path(source.spec), seed, log)
            made["gguf"] = Path(out) / f"{name}-q4_k_m.gguf"
    return made
