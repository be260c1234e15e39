"""Attention over the in-place cache, laid out position by position and read where it lies.

Each layer's cache buffer is [batch, positions, kv_heads, head_dim]: one row's positions are
contiguous, and within a position its kv heads. That layout (not optimum's [batch, kv_heads,
positions, head_dim]) is what lets a lone row's attention read its context without copying it:

- **One row bound at exactly the call's length** (the engine binds a lone row so): the buffer
  is [1, total, kv, hd], viewed as [total, kv, hd] at no cost, and each kv head's keys and values
  are strided [total, hd] matrices that ONNX Runtime's fused MatMul reads in place (its
  `transBatchB` folds the transposes). Measured on the default target's shape, attention alone
  at 8,000 positions: 41 ms a step against 67 ms for slicing the head-major buffer
  (`benchmarks/attention_kernels.py`).
- **Anything else** (a batch, or a buffer bound wider than the call): a Loop over the rows, each
  row's positions sliced out once (one contiguous copy, as the head-major slice was) and then
  the same ops on the same shapes. So a row scores the same alone and beside others, bit for bit,
  which speculation at any batch composition rests on (the engine probes it at load).

Fused kernels were measured and not taken: ONNX Runtime's GroupQueryAttention scores a verify
call of 4 tokens differently from 4 one-token calls and refuses a batched verify call.
Grouped-query attention folds each kv head's query heads into rows, so no kv head is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper


@dataclass(frozen=True)
class CallShapes:
    """What every layer's attention reads of the call: where new keys and values go, the call's
    total length, whether the cache is bound at exactly that length for one row, the rows and
    the bound length (for the row-by-row path), the score shapes of one row, the norms'
    epsilon."""

    scatter_at: str
    total: str
    exact: str  # bool scalar: one row, its buffer bound at `total` positions
    rows: str  # scalar: the call's rows
    bound: str  # [1]: the positions its caches are bound at
    grouped: str  # [kv, rep, -1, total]: one row's scores by query head group
    flat: str  # [kv, -1, total]: back to rows for the second MatMul
    eps: float
    kv: int
    head_dim: int


def call_shapes(b, kv: int, head_dim: int, eps: float, rep: int) -> CallShapes:
    """The call's shapes from its inputs (S new tokens a row, T total: the longest row's past +
    new). Each row's token s sits at position_ids[b, s], which is also its cache index."""
    ids_shape = b.op("Shape", "input_ids")
    batch = b.batch = b.op("Slice", ids_shape, b.const([0]), b.const([1]))
    seq = b.op("Slice", ids_shape, b.const([1]), b.const([2]))
    total = b.op("Slice", b.op("Shape", "attention_mask"), b.const([1]), b.const([2]))
    bound = b.op("Slice", b.op("Shape", "past_key_values.0.key"), b.const([1]), b.const([2]))
    lone = b.op("Equal", batch, b.const([1]))
    exact = b.op("Squeeze", b.op("And", lone, b.op("Equal", bound, total)), b.const([0]))
    kv_shape = b.op("Concat", batch, seq, b.const([kv, head_dim]), axis=0)
    scatter_at = b.op("Expand", b.op("Unsqueeze", "position_ids", b.const([2, 3])), kv_shape)
    grouped = b.op("Concat", b.const([kv, rep, -1]), total, axis=0)
    flat = b.op("Concat", b.const([kv, -1]), total, axis=0)
    rows = b.op("Squeeze", batch, b.const([0]))
    return CallShapes(scatter_at, total, exact, rows, bound, grouped, flat, eps, kv, head_dim)


def attend(b, i: int, q: str, k: str, v: str, a: CallShapes, mask: str) -> str:
    """Write this call's keys and values [B, S, kv, hd] into layer i's cache at their positions,
    then attend: q [B, kv, rep * S, hd] (scaled) -> context [B, kv, rep * S, hd]."""
    keys, values = (
        b.op(
            "ScatterElements",
            f"past_key_values.{i}.{kind}",
            a.scatter_at,
            new,
            axis=1,
            out=f"present.{i}.{kind}",
        )
        for kind, new in (("key", k), ("value", v))
    )
    by_position = b.const([-1, a.kv, a.head_dim])
    keys, values = b.op("Reshape", keys, by_position), b.op("Reshape", values, by_position)
    with b.branch() as nodes:  # one row, bound at its length: read in place
        q_row = b.op("Reshape", q, b.const([a.kv, -1, a.head_dim]))
        row = _row(b, keys, values, q_row, b.op("Gather", mask, b.const(0), axis=0), a)
        lone = b.op("Unsqueeze", row, b.const([0]))
    in_place = helper.make_graph(nodes, f"layer{i}_in_place", [], [_any(lone)])
    return b.op(
        "If", a.exact, then_branch=in_place, else_branch=_each_row(b, i, q, keys, values, a, mask)
    )


def _each_row(b, i: int, q: str, keys: str, values: str, a: CallShapes, mask: str):
    """The else branch: a Loop over the rows, each row's positions sliced out of the flattened
    [B * bound, kv, hd] buffer, then the lone row's ops; its scan output stacks the rows."""
    row_index, go_on = f"layer{i}_row", f"layer{i}_go_on"
    with b.branch() as body:
        start = b.op("Mul", b.op("Unsqueeze", row_index, b.const([0])), a.bound)
        end, first = b.op("Add", start, a.total), b.const([0])
        row_keys = b.op("Slice", keys, start, end, first)
        row_values = b.op("Slice", values, start, end, first)
        row_q = b.op("Gather", q, row_index, axis=0)
        row_mask = b.op("Gather", mask, row_index, axis=0)
        row = _row(b, row_keys, row_values, row_q, row_mask, a)
        kept = b.op("Identity", go_on)
    loop_body = helper.make_graph(
        body,
        f"layer{i}_each_row",
        [
            helper.make_tensor_value_info(row_index, TensorProto.INT64, []),
            helper.make_tensor_value_info(go_on, TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(kept, TensorProto.BOOL, []), _any(row)],
    )
    with b.branch() as nodes:
        stacked = b.op("Loop", a.rows, "", body=loop_body)
    return helper.make_graph(nodes, f"layer{i}_rows", [], [_any(stacked)])


def _row(b, keys: str, values: str, q: str, mask: str, a: CallShapes) -> str:
    """One row's attention: keys and values [T, kv, hd] (each kv head's a strided matrix that
    the fused MatMul reads in place), q [kv, rep * S, hd], mask [1, 1, S, T]; returns the
    context [kv, rep * S, hd]."""
    if b.cache != TensorProto.FLOAT:  # kept at half size, computed with in float32
        keys = b.op("Cast", keys, to=TensorProto.FLOAT)
        values = b.op("Cast", values, to=TensorProto.FLOAT)
    scores = b.op("MatMul", q, b.op("Transpose", keys, perm=[1, 2, 0]))  # [kv, rep * S, T]
    scores = softcap(b, b.op("Reshape", scores, a.grouped), b.family.attention_softcap())
    probs = b.op("Softmax", b.op("Add", scores, mask), axis=-1)
    values = b.op("Transpose", values, perm=[1, 0, 2])  # [kv, T, hd]
    return b.op("MatMul", b.op("Reshape", probs, a.flat), values)


def _any(name: str):
    """A branch or body output: float, its shape left to the run."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def softcap(b, x: str, cap: float | None) -> str:
    """tanh(x / cap) * cap where the family caps (Gemma 2), x itself where not."""
    if cap is None:
        return x
    scaled = b.op("Tanh", b.op("Div", x, b.const(cap, np.float32)))
    return b.op("Mul", scaled, b.const(cap, np.float32))
