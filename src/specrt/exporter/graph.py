"""Write a decoder-only transformer (Llama / Qwen2 / Mistral family) as one ONNX graph.

We emit the graph from the weights, as ONNX Runtime GenAI's model builder does, instead of tracing
PyTorch: tracing fixes the cache layout that transformers happens to use, while speculation needs
a cache that is preallocated once and updated in place.

I/O follows the optimum / GenAI naming so other tools recognise it:

    input_ids            int64 [batch, sequence]           new tokens per row (K+1 to verify)
    attention_mask       int64 [batch, total]              total = the longest row's past + new
    position_ids         int64 [batch, sequence]           each new token's position in its row
    logits_to_keep       int64 [1]                         score only the last n new positions
    past_key_values.N.key|value  float [batch, kv_heads, capacity, head_dim]
 -> logits               float [batch, n, vocab]
    present.N.key|value  float [batch, kv_heads, capacity, head_dim]

The one difference from optimum's concat graphs: past and present are the same preallocated
buffer (the bundle's max context plus a margin for padding). A token's position is its cache
index: each new key/value is scattered in at its own position_ids entry, and a token at
position p attends to its row's keys 0..p. Rows therefore keep their own lengths in one batch:
a row with fewer new tokens than the call is padded after its real ones (at the next positions,
which no real token sees and its next call overwrites). Bind each present output to its past
input's buffer and ONNX Runtime updates it in place (no copy of the cache per step); rolling a
row back is only smaller positions on its next call. `logits_to_keep` lets a prefill skip the
vocabulary projection for every prompt position but the last.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.errors import SpecrtError

OPSET = 18
IR_VERSION = 10  # what ONNX Runtime >= 1.18 and TensorRT 10 load
SUPPORTED = ("llama", "qwen2", "mistral")
ALIGN = 4096  # page-aligned weights can be memory-mapped


@dataclass(frozen=True)
class ModelShape:
    """The numbers the engines need to allocate caches; recorded in the manifest."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    def as_dict(self) -> dict:
        return asdict(self)


def model_shape(config) -> ModelShape:
    """Check the config is one this builder handles, and extract its dimensions."""
    arch = config.model_type
    if arch not in SUPPORTED:
        raise SpecrtError(f"architecture {arch!r} is not supported yet (supported: {SUPPORTED})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise SpecrtError(f"{arch}: activation {config.hidden_act!r} is not supported (silu only)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        architecture=arch,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
    )


class ExternalData:
    """Streams weights into one side file so the graph proto stays small."""

    def __init__(self, handle, location: str):
        self.handle = handle
        self.location = location
        self.offset = 0

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        pad = (-self.offset) % ALIGN
        self.handle.write(b"\0" * pad)
        self.offset += pad
        self.handle.write(memoryview(array).cast("B"))
        proto = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        proto.dims.extend(array.shape)
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.location),
            ("offset", self.offset),
            ("length", array.nbytes),
        ):
            proto.external_data.add(key=key, value=str(value))
        self.offset += array.nbytes
        return proto


class _Builder:
    """Appends nodes and initializers; every op returns the name of its single output."""

    def __init__(self, data: ExternalData):
        self.data = data
        self.nodes: list = []
        self.initializers: list = []
        self.count = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self.count += 1
        name = out or f"{op_type}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def const(self, value, dtype=np.int64, name: str | None = None) -> str:
        self.count += 1
        name = name or f"const_{self.count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, name: str, tensor) -> str:
        array = tensor.detach().to("cpu").float().numpy() if hasattr(tensor, "detach") else tensor
        self.initializers.append(self.data.tensor(name, array))
        return name


def _linear(b: _Builder, x: str, module, name: str) -> str:
    """x @ W^T (+ bias); weights are stored pre-transposed for MatMul."""
    y = b.op("MatMul", x, b.weight(f"{name}.weight_t", module.weight.detach().float().T))
    if getattr(module, "bias", None) is not None:
        y = b.op("Add", y, b.weight(f"{name}.bias", module.bias))
    return y


def _rms_norm(b: _Builder, x: str, module, name: str, eps: float) -> str:
    """The Pow/ReduceMean/Add/Sqrt/Div/Mul pattern ONNX Runtime fuses into one kernel."""
    var = b.op("ReduceMean", b.op("Pow", x, b.const(2.0, np.float32)), b.const([-1]), keepdims=1)
    std = b.op("Sqrt", b.op("Add", var, b.const(eps, np.float32)))
    return b.op("Mul", b.op("Div", x, std), b.weight(f"{name}.weight", module.weight))


def _rope(b: _Builder, x: str, cos: str, sin: str, half: int) -> str:
    """x * cos + rotate_half(x) * sin, with rotate_half = concat(-x2, x1) over the head dim."""
    x1 = b.op("Slice", x, b.const([0]), b.const([half]), b.const([3]))
    x2 = b.op("Slice", x, b.const([half]), b.const([2 * half]), b.const([3]))
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=3)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def _rope_tables(model, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin per position from the model's own rotary module (covers every rope scaling)."""
    import torch

    positions = torch.arange(capacity).unsqueeze(0)
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(probe, positions)
    return cos[0].float().numpy(), sin[0].float().numpy()


def write_graph(model, out_dir: Path, capacity: int) -> ModelShape:
    """Write model.onnx and model.onnx.data into out_dir; return the model's shape. capacity:
    the positions the rotary tables cover (the cache's, margin included)."""
    shape = model_shape(model.config)
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    rep = heads // kv
    eps = float(model.config.rms_norm_eps)
    inner = model.model
    with open(out_dir / "model.onnx.data", "wb") as handle:
        b = _Builder(ExternalData(handle, "model.onnx.data"))
        # Shapes: S new tokens, T total (the longest row's past + new). Each row's token s sits
        # at position_ids[b, s], which is also its cache index (rows have their own lengths).
        ids_shape = b.op("Shape", "input_ids")
        batch = b.op("Slice", ids_shape, b.const([0]), b.const([1]))
        seq = b.op("Slice", ids_shape, b.const([1]), b.const([2]))
        total = b.op("Slice", b.op("Shape", "attention_mask"), b.const([1]), b.const([2]))
        k_pos = b.op("Range", b.const(0), b.op("Squeeze", total, b.const([0])), b.const(1))

        # Additive mask [B, 1, 1, S, T]: key t is seen by a token at position p when t <= p
        # (its row's own prefix and its earlier new tokens) and the attention mask allows it.
        causal = b.op(
            "LessOrEqual",
            b.op("Unsqueeze", k_pos, b.const([0, 1])),
            b.op("Unsqueeze", "position_ids", b.const([2])),
        )
        keep = b.op("Cast", b.op("Unsqueeze", "attention_mask", b.const([1])), to=TensorProto.BOOL)
        allowed = b.op("Unsqueeze", b.op("And", causal, keep), b.const([1, 2]))
        mask = b.op(
            "Where",
            allowed,
            b.const(0.0, np.float32),
            b.const(np.finfo(np.float32).min, np.float32),
        )

        # Where this call's keys/values go in the cache buffer: each token at its own position.
        kv_shape = b.op("Concat", batch, b.const([kv]), seq, b.const([hd]), axis=0)
        scatter_at = b.op("Expand", b.op("Unsqueeze", "position_ids", b.const([1, 3])), kv_shape)
        grouped_scores = b.op("Concat", batch, b.const([kv, rep]), seq, total, axis=0)
        flat_scores = b.op("Concat", batch, b.const([kv, -1]), total, axis=0)

        cos_table, sin_table = _rope_tables(model, capacity)
        pos_cos = b.op("Gather", b.weight("rope.cos", cos_table), "position_ids")
        pos_sin = b.op("Gather", b.weight("rope.sin", sin_table), "position_ids")
        cos = b.op("Unsqueeze", pos_cos, b.const([1]))
        sin = b.op("Unsqueeze", pos_sin, b.const([1]))

        embed = b.weight("embed_tokens.weight", inner.embed_tokens.weight)
        x = b.op("Gather", embed, "input_ids")
        for i, layer in enumerate(inner.layers):
            x = _decoder_layer(
                b,
                x,
                layer,
                i,
                shape,
                eps,
                rep,
                cos,
                sin,
                mask,
                scatter_at,
                total,
                grouped_scores,
                flat_scores,
            )

        # Only the last `logits_to_keep` positions reach the norm and the vocabulary projection.
        x = b.op(
            "Slice",
            x,
            b.op("Neg", "logits_to_keep"),
            b.const([np.iinfo(np.int64).max]),
            b.const([1]),
        )
        x = _rms_norm(b, x, inner.norm, "norm", eps)
        _lm_head(b, x, model, embed, batch)

    graph = helper.make_graph(
        b.nodes, "specrt_decoder", _inputs(shape), _outputs(shape), initializer=b.initializers
    )
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="specrt",
    )
    onnx.save_model(proto, str(out_dir / "model.onnx"))
    return shape


def _decoder_layer(
    b, x, layer, i, shape, eps, rep, cos, sin, mask, scatter_at, total, grouped_scores, flat_scores
) -> str:
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    attn, prefix = layer.self_attn, f"layers.{i}"
    h = _rms_norm(b, x, layer.input_layernorm, f"{prefix}.input_layernorm", eps)

    def project(module, name, n_heads):  # [B, S, n*hd] -> [B, n, S, hd]
        y = _linear(b, h, module, f"{prefix}.self_attn.{name}")
        return b.op(
            "Transpose", b.op("Reshape", y, b.const([0, 0, n_heads, hd])), perm=[0, 2, 1, 3]
        )

    q = _rope(b, project(attn.q_proj, "q_proj", heads), cos, sin, hd // 2)
    k = _rope(b, project(attn.k_proj, "k_proj", kv), cos, sin, hd // 2)
    v = project(attn.v_proj, "v_proj", kv)
    keys = b.op(
        "ScatterElements", f"past_key_values.{i}.key", scatter_at, k, out=f"present.{i}.key", axis=2
    )
    values = b.op(
        "ScatterElements",
        f"past_key_values.{i}.value",
        scatter_at,
        v,
        out=f"present.{i}.value",
        axis=2,
    )
    first = b.const([0])
    keys = b.op("Slice", keys, first, total, b.const([2]))
    values = b.op("Slice", values, first, total, b.const([2]))

    # Grouped-query attention without repeating K/V: fold each group's query heads into rows.
    q = b.op("Mul", q, b.const(1.0 / math.sqrt(hd), np.float32))
    q = b.op("Reshape", q, b.const([0, kv, -1, hd]))
    scores = b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 3, 2]))
    scores = b.op("Add", b.op("Reshape", scores, grouped_scores), mask)
    probs = b.op("Reshape", b.op("Softmax", scores, axis=-1), flat_scores)
    ctx = b.op("Reshape", b.op("MatMul", probs, values), b.const([0, heads, -1, hd]))
    ctx = b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), b.const([0, 0, heads * hd]))
    x = b.op("Add", x, _linear(b, ctx, attn.o_proj, f"{prefix}.self_attn.o_proj"))

    h = _rms_norm(b, x, layer.post_attention_layernorm, f"{prefix}.post_attention_layernorm", eps)
    mlp = layer.mlp
    gate = _linear(b, h, mlp.gate_proj, f"{prefix}.mlp.gate_proj")
    up = _linear(b, h, mlp.up_proj, f"{prefix}.mlp.up_proj")
    act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
    return b.op("Add", x, _linear(b, act, mlp.down_proj, f"{prefix}.mlp.down_proj"))


def _lm_head(b: _Builder, x: str, model, embed: str, batch: str) -> None:
    """Tied heads reuse the embedding matrix through Gemm(transB) rather than a transposed copy."""
    head = model.lm_head
    if head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        flat = b.op("Reshape", x, b.const([-1, model.config.hidden_size]))
        logits = b.op("Gemm", flat, embed, transB=1)
        out_shape = b.op("Concat", batch, b.const([-1, model.config.vocab_size]), axis=0)
        b.op("Reshape", logits, out_shape, out="logits")
    else:
        b.op("Identity", _linear(b, x, head, "lm_head"), out="logits")


def _inputs(shape: ModelShape) -> list:
    cache = ["batch_size", shape.num_kv_heads, "capacity", shape.head_dim]
    inputs = [
        helper.make_tensor_value_info(
            "input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]
        ),
        helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
        ),
        helper.make_tensor_value_info(
            "position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]
        ),
        helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
    ]
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache
                )
            )
    return inputs


def _outputs(shape: ModelShape) -> list:
    cache = ["batch_size", shape.num_kv_heads, "capacity", shape.head_dim]
    outputs = [
        helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT, ["batch_size", "kept", shape.vocab_size]
        )
    ]
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, cache)
            )
    return outputs
