"""Attention that every row of a batch runs at once: the graph GPU providers get.

The CPU graph (attention.py) chooses per call between reading a lone row's cache in place and a
Loop over the rows. On ONNX Runtime's CUDA provider that costs what the CPU saves: the If
condition, the Loop's counter and the row index live on the host, so Memcpy nodes sit in every
layer (a host sync each), CUDA graphs are ruled out (no control flow may be captured), and a
batch of 8 cost ~4x one row on an H100 (issue 52). This graph has neither:

- **Caches by head**, [batch, kv_heads, positions, head_dim] (optimum's and GenAI's layout):
  each kv head's keys are one [positions, head_dim] matrix that MatMul reads transposed (ONNX
  Runtime folds the Transpose into its MatMul), so nothing copies the cache.
- **Every call attends over the whole bound buffer.** `attention_mask` is as wide as the
  caches are bound (the engine binds them whole), and each token sees its row's keys up to its
  own position (`position_ids`), within its layer's sliding window. A call's shapes then
  depend on its rows and width only, never on how long the rows are: what one CUDA graph per
  (rows, width) needs. The price is attention over positions no row reached yet (masked); a
  fused kernel with per-row lengths would skip them (ONNX opset 24's `nonpad_kv_seqlen`).
- **No shape arithmetic feeds a device tensor**: sizes come from `Shape` and go only to inputs
  the CUDA kernels read on the host (Range's bounds, Expand's and Reshape's shapes), which ONNX
  Runtime computes on the CPU without a copy; GPU tests count the Memcpy nodes.

Two forms of the same attention, chosen at build (`FORMS`): `matmul` (MatMul, Softmax, MatMul
over each kv head's folded query heads, as the CPU graph computes) and `onnx` (ONNX's own
`Attention` op, opset 23, which a provider may run as one fused kernel). Which is faster on a
GPU is what `benchmarks/gpu_calls.py` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from specrt.errors import SpecrtError
from specrt.exporter.attention import softcap

FORMS = ("matmul", "onnx")
OPSET_OF_FORM = {"matmul": 18, "onnx": 23}  # ONNX's Attention op came with opset 23
CACHE_DIMS = ("batch_size", "kv_heads", "positions", "head_dim")  # by head


@dataclass(frozen=True)
class BatchedCall:
    """What every layer reads of the call: where new keys and values go ([B, kv, S, hd]
    indices), the key positions [1, 1, P] and the form's parameters."""

    form: str
    scatter_at: str
    key_positions: str
    eps: float
    kv: int
    heads: int
    head_dim: int


def batched_call(b, form: str, heads: int, kv: int, head_dim: int, eps: float) -> BatchedCall:
    """The call's shapes from its inputs: S new tokens a row at position_ids, attention over
    the P positions attention_mask is as wide as (the bound cache)."""
    ids_shape = b.op("Shape", "input_ids")
    batch = b.batch = b.op("Slice", ids_shape, b.const([0]), b.const([1]))
    seq = b.op("Slice", ids_shape, b.const([1]), b.const([2]))
    kv_shape = b.op("Concat", batch, b.const([kv]), seq, b.const([head_dim]), axis=0)
    scatter_at = b.op("Expand", b.op("Unsqueeze", "position_ids", b.const([1, 3])), kv_shape)
    bound = b.op("Slice", b.op("Shape", "attention_mask"), b.const([1]), b.const([2]))
    k_pos = b.op("Range", b.const(0), b.op("Squeeze", bound, b.const([0])), b.const(1))
    key_positions = b.op("Unsqueeze", k_pos, b.const([0, 1]))
    return BatchedCall(form, scatter_at, key_positions, eps, kv, heads, head_dim)


def batched_mask(b, a: BatchedCall, visible: str) -> str:
    """A window's mask in the form's terms from visible [B, S, P] (bool): ONNX's Attention
    takes it as it is ([B, 1, S, P]); the matmul form adds 0 or the float minimum to scores
    whose rows are the kv head's query heads one after another ([B, 1, rep * S, P])."""
    visible = b.op("Unsqueeze", visible, b.const([1]))
    if a.form == "onnx":
        return visible
    rows = b.op("Tile", visible, b.const([1, 1, a.heads // a.kv, 1]))
    low = np.finfo(np.float32).min
    return b.op("Where", rows, b.const(0.0, np.float32), b.const(low, np.float32))


def attend_batched(b, i: int, q: str, k: str, v: str, a: BatchedCall, mask: str, cap) -> str:
    """Write this call's keys and values (k, v: [B, S, kv, hd]) into layer i's caches at their
    positions, then attend: q [B, kv, rep * S, hd] (scaled) -> context [B, heads, S, hd] (the
    same memory as [B, kv, rep * S, hd]). cap: the family's score softcap or None."""
    keys, values = (
        b.op(
            "ScatterElements",
            f"past_key_values.{i}.{kind}",
            a.scatter_at,
            b.op("Transpose", new, perm=[0, 2, 1, 3]),
            axis=2,
            out=f"present.{i}.{kind}",
        )
        for kind, new in (("key", k), ("value", v))
    )
    if b.cache != TensorProto.FLOAT:  # kept at half size, computed with in float32
        keys = b.op("Cast", keys, to=TensorProto.FLOAT)
        values = b.op("Cast", values, to=TensorProto.FLOAT)
    if a.form == "onnx":
        by_head = b.op("Reshape", q, b.const([0, a.heads, -1, a.head_dim]))
        options = {} if cap is None else {"softcap": float(cap)}
        return b.op("Attention", by_head, keys, values, mask, scale=1.0, **options)
    scores = b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 3, 2]))  # [B, kv, R, P]
    probs = b.op("Softmax", b.op("Add", softcap(b, scores, cap), mask), axis=-1)
    return b.op("MatMul", probs, values)


GPU_PRECISIONS = ("fp16", "fp32")
GPU_FOLDER = "gpu"  # inside a role's folder


@dataclass(frozen=True)
class GpuGraph:
    """A role's second graph, for ONNX Runtime's CUDA provider: this attention at fp16 (the
    default: the issue's goals are fp16 figures) or fp32. The CPU graph and its guarantees
    stay; the manifest records this one under the role's `gpu` entry, with the backends that
    run it."""

    attention: str = "matmul"
    precision: str = "fp16"

    def __post_init__(self) -> None:
        if self.attention not in FORMS:
            raise SpecrtError(f"GPU attention {self.attention!r} is not one of {FORMS}")
        if self.precision not in GPU_PRECISIONS:
            raise SpecrtError(f"GPU precision {self.precision!r} is not one of {GPU_PRECISIONS}")

    def as_dict(self) -> dict:
        return {
            "graph": f"{GPU_FOLDER}/model.onnx",
            "attention": self.attention,
            "precision": self.precision,
            "kv_cache_layout": "by_head",
            "backends": ["onnxruntime-cuda"],
        }
