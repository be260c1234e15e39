"""Write a decoder-only transformer (Llama 2/3, Qwen2, Qwen3, Mistral) as one ONNX graph.

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
    past_key_values.N.key|value  float [batch, positions, kv_heads, head_dim]
    row_view.R.N.key|value       float [1, positions, kv_heads, head_dim]  optional: row R's
 -> logits               float [batch, n, vocab]
    present.N.key|value  float [batch, positions, kv_heads, head_dim]

Two differences from optimum's concat graphs. Past and present are the same preallocated
buffer (the bundle's max context plus a margin for padding), bound at `positions`: a lone row's
at exactly the call's total (its attention then reads the cache in place), otherwise at the
buffer's whole length, with each row's view of it (attention.py). And that buffer is laid out
position by position, not kv head by kv head: the layout that lets attention skip the copy.

A token's position is its cache index: each new key/value is scattered in at its own
position_ids entry, and a token at position p attends to its row's keys 0..p. Rows therefore
keep their own lengths in one batch: a row with fewer new tokens than the call is padded after
its real ones (at the next positions, which no real token sees and its next call overwrites).
Bind each present output to its past input's buffer and ONNX Runtime updates it in place (no
copy of the cache per step); rolling a row back is only smaller positions on its next call.
`logits_to_keep` lets a prefill skip the vocabulary projection for every prompt position but
the last. GPU providers get a second graph, `attention` in batched_attention.FORMS: the same
model with every row of a batch in one attention and the caches laid out by head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.exporter.attention import CallShapes, attend, call_shapes, softcap
from specrt.exporter.batched_attention import (
    OPSET_OF_FORM,
    BatchedCall,
    attend_batched,
    batched_call,
    batched_mask,
)
from specrt.exporter.external_data import ExternalData
from specrt.exporter.families import Family, family_of
from specrt.exporter.graph_io import graph_inputs, graph_outputs
from specrt.exporter.projections import FloatProjections
from specrt.exporter.tensors import Tensors

OPSET = 18
Call = CallShapes | BatchedCall  # what the layers read of a call, by attention
IR_VERSION = 10  # what ONNX Runtime >= 1.18 and TensorRT 10 load
# The types a cache may be kept in. float16 halves its memory and what attention reads; the
# new keys and values are rounded as they are written, and every call (prefill, decode,
# verify) reads them back from the cache, so the model stays one model whatever the cut.
CACHE_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


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
    family_of(config)  # refuses what no family writes, naming the config field
    arch = config.model_type
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

    def __init__(self, data: ExternalData, tensors: Tensors, projections, family: Family):
        self.data, self.tensors, self.projections = data, tensors, projections
        self.family = family
        self.nodes: list = []
        self.initializers: list = []
        self.consts: dict = {}  # (dtype, shape, bytes) -> the initializer holding that value
        self.count = 0
        self.batch = ""  # the batch size as a 1-d tensor, set once the inputs are read
        self.cache = TensorProto.FLOAT  # the type keys and values are kept in
        self.attention = "in_place"  # or a batched form (batched_attention.FORMS)

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain=None, **attrs) -> str:
        self.count += 1
        name = out or f"{op_type}_{self.count}"
        node = helper.make_node(op_type, list(inputs), [name], name=name, domain=domain, **attrs)
        self.nodes.append(node)
        return name

    @contextmanager
    def branch(self) -> Iterator[list]:
        """Nodes added inside go to the list it yields (an If branch, a Loop body), not to the
        graph; they may read any value of the graph built so far."""
        outer, self.nodes = self.nodes, []
        try:
            yield self.nodes
        finally:
            self.nodes = outer

    def const(self, value, dtype=np.int64, name: str | None = None) -> str:
        """A constant, one initializer per value unless named: a subgraph (an If branch, a
        Loop body) takes each outer constant it reads as an implicit input, which ONNX Runtime
        hands over on every execution, so copies of one value cost run time."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if name is None and key in self.consts:
            return self.consts[key]
        self.count += 1
        if name is None:
            name = self.consts[key] = f"const_{self.count}"
        self.initializers.append(numpy_helper.from_array(array, name))
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
    weight = b.tensors.get(f"{module}.weight") + np.float32(b.family.norm_offset)
    scale = b.weight(f"{name}.weight", weight)
    return b.op("Mul", b.op("Div", x, std), scale)


@dataclass(frozen=True)
class Rotary:
    """Each new token's cos/sin rows ([B, 1, S, rotary]) and the dims they turn: all of a head,
    or its first `rotary` dims where the config has a partial_rotary_factor (Phi-4-mini)."""

    cos: str
    sin: str
    rotary: int
    head_dim: int


def _rope(b: _Builder, x: str, r: Rotary) -> str:
    """x * cos + rotate_half(x) * sin over the rotary dims, rotate_half = concat(-x2, x1); the
    rest of the head passes through."""
    half, axis = r.rotary // 2, b.const([3])
    turned = (
        x if r.rotary == r.head_dim else b.op("Slice", x, b.const([0]), b.const([r.rotary]), axis)
    )
    x1 = b.op("Slice", turned, b.const([0]), b.const([half]), axis)
    x2 = b.op("Slice", turned, b.const([half]), b.const([r.rotary]), axis)
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=3)
    out = b.op("Add", b.op("Mul", turned, r.cos), b.op("Mul", rotated, r.sin))
    if r.rotary == r.head_dim:
        return out
    kept = b.op("Slice", x, b.const([r.rotary]), b.const([r.head_dim]), axis)
    return b.op("Concat", out, kept, axis=3)


def rope_tables(
    config, capacity: int, layer_type: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin per position from the model's own rotary class, built from its config alone
    (no weights), so every rope scaling transformers knows is covered."""
    import importlib

    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    module = importlib.import_module(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__)
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    positions = torch.arange(capacity).unsqueeze(0)
    with torch.no_grad():
        probe = torch.zeros(1, dtype=torch.float32)
        by_type = {} if layer_type is None else {"layer_type": layer_type}
        cos, sin = rotary(config=config)(probe, positions, **by_type)
    return cos[0].float().numpy(), sin[0].float().numpy()


def write_graph(
    tensors: Tensors,
    out_dir: Path,
    capacity: int,
    projections=None,
    cache: str = "float32",
    attention: str = "in_place",
) -> ModelShape:
    """Write model.onnx and model.onnx.data into out_dir from the weights, one tensor at a
    time; return the model's shape. capacity: the positions the rotary tables cover (the
    cache's, margin included). projections: how weight matrices are written (float32 when
    None; see projections.py). cache: the type keys and values are kept in (CACHE_TYPES).
    attention: "in_place" (the CPU graph, attention.py) or a form of the batched attention
    GPU providers get (batched_attention.FORMS), whose caches are laid out by head."""
    config = tensors.config
    shape = model_shape(config)
    projections = projections or FloatProjections()
    with open(out_dir / "model.onnx.data", "wb") as handle:
        family = family_of(config)
        family.check_capacity(capacity)
        b = _Builder(ExternalData(handle, "model.onnx.data"), tensors, projections, family)
        b.cache, b.attention = CACHE_TYPES[cache], attention
        call, masks = _call_shapes(b, shape, float(config.rms_norm_eps))
        windows = family.windows()
        keys = [family.rope_key(i) for i in range(shape.num_layers)]
        rotaries = {k: _rotary(b, config, capacity, k, shape.head_dim) for k in dict.fromkeys(keys)}
        x, embed = projections.embedding(b, "model.embed_tokens.weight")
        if family.embed_scale() is not None:
            x = b.op("Mul", x, b.const(family.embed_scale(), np.float32))
        for i in range(shape.num_layers):
            x = _decoder_layer(b, x, i, shape, call, rotaries[keys[i]], masks[windows[i]])
        _head(b, x, embed, call.eps)
    _save(b, shape, out_dir / "model.onnx")
    return shape


def _call_shapes(b: _Builder, shape: ModelShape, eps: float) -> tuple[Call, dict]:
    """What every layer's attention reads of the call, and its masks by sliding window: key t
    is seen by a token at position p when t <= p (its row's own prefix and its earlier new
    tokens) and the attention mask allows it; in a layer with a sliding window W, only when
    also t > p - W."""
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if b.attention == "in_place":
        a: Call = call_shapes(b, kv, hd, eps, heads // kv)
        k_pos = b.op("Range", b.const(0), b.op("Squeeze", a.total, b.const([0])), b.const(1))
        key_positions = b.op("Unsqueeze", k_pos, b.const([0, 1]))
    else:
        a = batched_call(b, b.attention, heads, kv, hd, eps)
        key_positions = a.key_positions
    causal = b.op("LessOrEqual", key_positions, b.op("Unsqueeze", "position_ids", b.const([2])))
    keep = b.op("Cast", b.op("Unsqueeze", "attention_mask", b.const([1])), to=TensorProto.BOOL)
    allowed = b.op("And", causal, keep)  # [B, S, T]
    masks = {}
    for window in sorted(set(b.family.windows()), key=str):
        visible = _in_window(b, allowed, key_positions, window)
        masks[window] = (
            batched_mask(b, a, visible)
            if isinstance(a, BatchedCall)
            else (_additive_mask(b, visible))
        )
    return a, masks


def _head(b: _Builder, x: str, embed, eps: float) -> None:
    """The final norm and the vocabulary projection, for the last `logits_to_keep` positions
    only (a prefill needs one)."""
    # The first row kept, S - logits_to_keep, from the call's shape: a size computed where
    # sizes are (the host), since on a GPU a Neg of the input would run on the device and
    # copy its result back for Slice to read (a Memcpy node; batched_attention.py).
    seq = b.op("Slice", b.op("Shape", x), b.const([1]), b.const([2]))
    first = b.op("Sub", seq, "logits_to_keep")
    x = b.op("Slice", x, first, b.const([np.iinfo(np.int64).max]), b.const([1]))
    x = _rms_norm(b, x, "model.norm", "norm", eps)
    config, tensors = b.tensors.config, b.tensors
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in tensors
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    logits = b.projections.head(b, x, head, embed if tied else None)
    b.op("Identity", softcap(b, logits, b.family.final_softcap()), out="logits")


def _save(b: _Builder, shape: ModelShape, path: Path) -> None:
    inputs, defaults = graph_inputs(shape, b.cache, b.attention)
    graph = helper.make_graph(
        b.nodes,
        "specrt_decoder",
        inputs,
        graph_outputs(shape, b.cache, b.attention),
        initializer=b.initializers + defaults,
    )
    opsets = [helper.make_opsetid("", OPSET_OF_FORM.get(b.attention, OPSET))]
    if any(node.domain == "com.microsoft" for node in b.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    proto = helper.make_model(
        graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="specrt"
    )
    onnx.save_model(proto, str(path))


def _head_norm(b: _Builder, x: str, module: str, name: str, eps: float) -> str:
    """An RMSNorm of each query / key head before the rotary (Qwen3, Gemma 3), where the
    weights have one."""
    if f"{module}.weight" not in b.tensors:
        return x
    return _rms_norm(b, x, module, name, eps)


def _in_window(b: _Builder, allowed: str, key_positions: str, window: int | None) -> str:
    """The keys a token sees in a layer with this sliding window (None: every allowed one)."""
    if window is None:
        return allowed
    oldest = b.op("Sub", b.op("Unsqueeze", "position_ids", b.const([2])), b.const(window))
    return b.op("And", allowed, b.op("Greater", key_positions, oldest))


def _additive_mask(b: _Builder, visible: str) -> str:
    """0 where a key is seen, the float minimum where not, [B, 1, 1, S, T]."""
    return b.op(
        "Where",
        b.op("Unsqueeze", visible, b.const([1, 2])),
        b.const(0.0, np.float32),
        b.const(np.finfo(np.float32).min, np.float32),
    )


def _decoder_layer(
    b: _Builder, x: str, i: int, shape: ModelShape, a: Call, rotary: Rotary, mask: str
) -> str:
    """One block: x + attention(norm(x)), then x + mlp(norm(x)); a sandwich family (Gemma)
    also norms each block's output before adding it."""
    source, prefix = f"model.layers.{i}", f"layers.{i}"

    def norm(h: str, name: str) -> str:
        return _rms_norm(b, h, f"{source}.{name}", f"{prefix}.{name}", a.eps)

    h = _self_attention(b, norm(x, "input_layernorm"), i, shape, a, rotary, mask)
    if b.family.sandwich:
        x = b.op("Add", x, norm(h, "post_attention_layernorm"))
        h = _mlp(b, norm(x, "pre_feedforward_layernorm"), source, prefix)
        return b.op("Add", x, norm(h, "post_feedforward_layernorm"))
    x = b.op("Add", x, h)
    return b.op("Add", x, _mlp(b, norm(x, "post_attention_layernorm"), source, prefix))


def _self_attention(
    b: _Builder, h: str, i: int, shape: ModelShape, a: Call, rotary: Rotary, mask: str
) -> str:
    heads, kv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    source, prefix = f"model.layers.{i}.self_attn", f"layers.{i}.self_attn"

    def project(name, n_heads):  # [B, S, n*hd] -> [B, n, S, hd]
        y = b.linear(h, f"{source}.{name}", f"{prefix}.{name}")
        return b.op(
            "Transpose", b.op("Reshape", y, b.const([0, 0, n_heads, hd])), perm=[0, 2, 1, 3]
        )

    q = _head_norm(b, project("q_proj", heads), f"{source}.q_norm", f"{prefix}.q_norm", a.eps)
    k = _head_norm(b, project("k_proj", kv), f"{source}.k_norm", f"{prefix}.k_norm", a.eps)
    q, k = _rope(b, q, rotary), _rope(b, k, rotary)
    k = b.op("Transpose", k, perm=[0, 2, 1, 3])  # [B, S, kv, hd]: the cache's layout
    v = b.linear(h, f"{source}.v_proj", f"{prefix}.v_proj")
    v = b.op("Reshape", v, b.const([0, 0, kv, hd]))
    if b.cache != TensorProto.FLOAT:  # kept at half size, computed with in float32
        k, v = b.op("Cast", k, to=b.cache), b.op("Cast", v, to=b.cache)
    # Grouped-query attention without repeating K/V: fold each group's query heads into rows.
    q = b.op("Mul", q, b.const(b.family.attention_scale(hd), np.float32))
    q = b.op("Reshape", q, b.const([0, kv, -1, hd]))
    if isinstance(a, BatchedCall):
        ctx = attend_batched(b, i, q, k, v, a, mask, b.family.attention_softcap())
    else:
        ctx = attend(b, i, q, k, v, a, mask)
    ctx = b.op("Reshape", ctx, b.const([0, heads, -1, hd]))
    ctx = b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), b.const([0, 0, heads * hd]))
    return b.linear(ctx, f"{source}.o_proj", f"{prefix}.o_proj")


def _mlp(b: _Builder, h: str, source: str, prefix: str) -> str:
    """down(activation(gate(h)) * up(h)): SwiGLU, or GeGLU for Gemma."""
    gate = b.linear(h, f"{source}.mlp.gate_proj", f"{prefix}.mlp.gate_proj")
    up = b.linear(h, f"{source}.mlp.up_proj", f"{prefix}.mlp.up_proj")
    act = b.op("Mul", b.family.activation(b, gate), up)
    return b.linear(act, f"{source}.mlp.down_proj", f"{prefix}.mlp.down_proj")


def _rotary(b: _Builder, config, capacity: int, key: str | None, head_dim: int) -> Rotary:
    """One rotary table's cos/sin rows for this call's positions ([B, 1, S, rotary])."""
    cos_table, sin_table = rope_tables(config, capacity, key)
    suffix = "" if key is None else f".{key}"
    pos_cos = b.op("Gather", b.weight(f"rope.cos{suffix}", cos_table), "position_ids")
    pos_sin = b.op("Gather", b.weight(f"rope.sin{suffix}", sin_table), "position_ids")
    cos = b.op("Unsqueeze", pos_cos, b.const([1]))
    sin = b.op("Unsqueeze", pos_sin, b.const([1]))
    return Rotary(cos, sin, cos_table.shape[-1], head_dim)
