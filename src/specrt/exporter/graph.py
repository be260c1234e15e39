"""Write a decoder-only transformer (Llama / Qwen2 / Mistral family) as one ONNX graph.

We emit the graph from the weights, as ONNX Runtime GenAI's model builder does, instead of tracing
PyTorch: tracing fixes the cache layout that transformers happens to use, while speculation needs
a cache that is preallocated once and updated in place. The weights are read one tensor at a time
(exporter.tensors) and written by the role's precision (exporter.projections) straight into the
side file, so writing a graph never holds the model.

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
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.errors import SpecrtError
from specrt.exporter.external_data import ExternalData
from specrt.exporter.projections import FloatProjections
from specrt.exporter.tensors import Tensors

OPSET = 18
IR_VERSION = 10  # what ONNX Runtime >= 1.18 and TensorRT 10 load
SUPPORTED = ("llama", "qwen2", "mistral")


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


class _Builder:
    """Appends nodes and initializers; every op returns the name of its single output. It
    carries what every piece of the graph reads: the weights and how projections are written."""

    def __init__(self, data: ExternalData, tensors: Tensors, projections):
        self.data, self.tensors, self.projections = data, tensors, projections
        self.nodes: list = []
        self.initializers: list = []
        self.count = 0
        self.batch = ""  # the batch size as a 1-d tensor, set once the inputs are read

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain=None, **attrs) -> str:
        self.count += 1
        name = out or f"{op_type}_{self.count}"
        node = helper.make_node(op_type, list(inputs), [name], name=name, domain=domain, **attrs)
        self.nodes.append(node)
        return name

    def const(self, value, dtype=np.int64, name: str | None = None) -> str:
        self.count += 1
        name = name or f"const_{self.count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self.data.tensor(name, array))
        return name

    def weight_from_bands(self, name: str, bands: Iterable[np.ndarray]) -> str:
        self.initializers.append(self.data.tensor_from_bands(name, bands))
        return name

    def weight_bands(self, name: str, source: str) -> str:
        """A source tensor as a float32 initializer, streamed by bands of rows."""
        return self.weight_from_bands(name, (rows for _, rows in self.tensors.bands(source)))

    def linear(self, x: str, module: str, name: str) -> str:
        """x @ W^T (+ bias) for the Linear `module` (a Hugging Face module name)."""
        y = self.projections.linear(self, x, f"{module}.weight", name)
        if f"{module}.bias" in self.tensors:
            y = self.op("Add", y, self.weight(f"{name}.bias", self.tensors.get(f"{module}.bias")))
        return y


def _rms_norm(b: _Builder, x: str, module: str, name: str, eps: float) -> str:
    """The Pow/ReduceMean/Add/Sqrt/Div/Mul pattern ONNX Runtime fuses into one kernel."""
    var = b.op("ReduceMean", b.op("Pow", x, b.const(2.0, np.float32)), b.const([-1]), keepdims=1)
    std = b.op("Sqrt", b.op("Add", var, b.const(eps, np.float32)))
    scale = b.weight(f"{name}.weight", b.tensors.get(f"{module}.weight"))
    return b.op("Mul", b.op("Div", x, std), scale)


def _rope(b: _Builder, x: str, cos: str, sin: str, half: int) -> str:
    """x * cos + rotate_half(x) * sin, with rotate_half = concat(-x2, x1) over the head dim."""
    x1 = b.op("Slice", x, b.const([0]), b.const([half]), b.const([3]))
    x2 = b.op("Slice", x, b.const([half]), b.const([2 * half]), b.const([3]))
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=3)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def rope_tables(config, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin per position from the model's own rotary class, built from its config alone
    (no weights), so every rope scaling transformers knows is covered."""
    import importlib

    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    module = importlib.import_module(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__)
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    positions = torch.arange(capacity).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(config=config)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].float().numpy(), sin[0].float().numpy()


def write_graph(tensors: Tensors, out_dir: Path, capacity: int, projections=None) -> ModelShape:
    """Write model.onnx and model.onnx.data into out_dir from the weights, one tensor at a
    time; return the model's shape. capacity: the positions the rotary tables cover (the
    cache's, margin included). projections: how weight matrices are written (float32 when
    None; see projections.py)."""
    config = tensors.config
    shape = model_shape(config)
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    rep = heads // kv
    eps = float(config.rms_norm_eps)
    projections = projections or FloatProjections()
    with open(out_dir / "model.onnx.data", "wb") as handle:
        b = _Builder(ExternalData(handle, "model.onnx.data"), tensors, projections)
        # Shapes: S new tokens, T total (the longest row's past + new). Each row's token s sits
        # at position_ids[b, s], which is also its cache index (rows have their own lengths).
        ids_shape = b.op("Shape", "input_ids")
        batch = b.batch = b.op("Slice", ids_shape, b.const([0]), b.const([1]))
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

        cos_table, sin_table = rope_tables(config, capacity)
        pos_cos = b.op("Gather", b.weight("rope.cos", cos_table), "position_ids")
        pos_sin = b.op("Gather", b.weight("rope.sin", sin_table), "position_ids")
        cos = b.op("Unsqueeze", pos_cos, b.const([1]))
        sin = b.op("Unsqueeze", pos_sin, b.const([1]))

        embed = b.weight_bands("embed_tokens.weight", "model.embed_tokens.weight")
        x = b.op("Gather", embed, "input_ids")
        for i in range(shape.num_layers):
            x = _decoder_layer(
                b,
                x,
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
        x = _rms_norm(b, x, "model.norm", "norm", eps)
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in tensors
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        logits = projections.head(b, x, head, embed if tied else None)
        b.op("Identity", logits, out="logits")

    graph = helper.make_graph(
        b.nodes, "specrt_decoder", _inputs(shape), _outputs(shape), initializer=b.initializers
    )
    opsets = [helper.make_opsetid("", OPSET)]
    if any(node.domain == "com.microsoft" for node in b.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    proto = helper.make_model(
        graph,
        opset_imports=opsets,
        ir_version=IR_VERSION,
        producer_name="specrt",
    )
    onnx.save_model(proto, str(out_dir / "model.onnx"))
    return shape


def _decoder_layer(
    b, x, i, shape, eps, rep, cos, sin, mask, scatter_at, total, grouped_scores, flat_scores
) -> str:
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    source, prefix = f"model.layers.{i}", f"layers.{i}"
    h = _rms_norm(b, x, f"{source}.input_layernorm", f"{prefix}.input_layernorm", eps)

    def project(name, n_heads):  # [B, S, n*hd] -> [B, n, S, hd]
        y = b.linear(h, f"{source}.self_attn.{name}", f"{prefix}.self_attn.{name}")
        return b.op(
            "Transpose", b.op("Reshape", y, b.const([0, 0, n_heads, hd])), perm=[0, 2, 1, 3]
        )

    q = _rope(b, project("q_proj", heads), cos, sin, hd // 2)
    k = _rope(b, project("k_proj", kv), cos, sin, hd // 2)
    v = project("v_proj", kv)
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
    x = b.op("Add", x, b.linear(ctx, f"{source}.self_attn.o_proj", f"{prefix}.self_attn.o_proj"))

    post = "post_attention_layernorm"
    h = _rms_norm(b, x, f"{source}.{post}", f"{prefix}.{post}", eps)
    gate = b.linear(h, f"{source}.mlp.gate_proj", f"{prefix}.mlp.gate_proj")
    up = b.linear(h, f"{source}.mlp.up_proj", f"{prefix}.mlp.up_proj")
    act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
    return b.op("Add", x, b.linear(act, f"{source}.mlp.down_proj", f"{prefix}.mlp.down_proj"))


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
