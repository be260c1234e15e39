"""Attention over the in-place cache, laid out position by position and read where it lies.

Each layer's cache buffer is [batch, positions, kv_heads, head_dim]: one row's positions are
contiguous, and within a position its kv heads. That layout (not optimum's [batch, kv_heads,
positions, head_dim]) is what lets a lone row's attention read its context without copying it:

- **One row bound at exactly the call's length** (the engine binds a lone row so): the buffer
  is [1, total, kv, hd], viewed as [total, kv, hd] at no cost, and each kv head's keys and values
  are strided [total, hd] matrices that ONNX Runtime's fused MatMul reads in place (its
  `transBatchB` folds the transposes). Measured on the default target's shape, attention alone
  at 8,000 positions: 39 ms a step against 56 ms for slicing the head-major buffer
  (`benchmarks/attention_kernels.py`).
- **A batch of up to VIEW_ROWS rows bound with its row views**: the caches are bound whole (a
  slot's rows are not contiguous at any other length), the new keys and values scattered into
  them, and each row's attention then reads its own positions through an optional input per
  cache, `row_view` (bundle.py), which the engine binds to that row's positions [1, length, kv,
  hd] where they lie. A chain of Ifs runs the rows the call has and no more. Each row takes the
  lone row's ops on a lone row's shapes, so it scores the same alone and beside others, bit for
  bit, which speculation at any batch composition rests on (the engine probes it at load).
- **Anything else** (a wider batch, a batch bound without its views, a buffer bound wider than
  the call): a Loop over the rows, each row's positions sliced out once (one contiguous copy of
  its context a layer) and then the same ops on the same shapes. On a shared machine that copy
  is what swings: `benchmarks/batch_reads.py` (limits.md, the Attention item).

Fused kernels were measured and not taken: ONNX Runtime's GroupQueryAttention scores a verify
call of 4 tokens differently from 4 one-token calls and refuses a batched verify call.
Grouped-query attention folds each kv head's query heads into rows, so no kv head is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from specrt.bundle import VIEW_ROWS, row_view


@dataclass(frozen=True)
class CallShapes:
    """What every layer's attention reads of the call: where new keys and values go, the call's
    total length, whether the cache is bound at exactly that length for one row, the rows and
    the bound length (for the row-by-row path), the score shapes of one row, the norms'
    epsilon."""

    scatter_at: str
    total: str
    exact: str  # bool scalar: one row, its buffer bound at `total` positions
    viewed: str  # bool scalar: a batch of 2 to VIEW_ROWS rows, its row views bound
    rows: str  # scalar: the call's rows
    bound: str  # [1]: the positions its caches are bound at
    grouped: str  # [kv, rep, -1, total]: one row's scores by query head group
    flat: str  # [kv, -1, total]: back to rows for the second MatMul
    eps: float
    kv: int
    head_dim: int
    rep: int  # query heads a kv head


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
    view = b.op("Shape", row_view("past_key_values.0.key", 0))  # [1, 0, kv, hd] where unbound
    bound_views = b.op("Greater", b.op("Slice", view, b.const([1]), b.const([2])), b.const([0]))
    in_reach = b.op("LessOrEqual", batch, b.const([VIEW_ROWS]))
    # Never a lone row: the engine binds views for batches only, so a lone row's may be stale.
    viewed = b.op("And", b.op("And", bound_views, in_reach), b.op("Not", lone))
    viewed = b.op("Squeeze", viewed, b.const([0]))
    kv_shape = b.op("Concat", batch, seq, b.const([kv, head_dim]), axis=0)
    scatter_at = b.op("Expand", b.op("Unsqueeze", "position_ids", b.const([2, 3])), kv_shape)
    grouped, flat = _score_shapes(b, kv, rep, total)
    rows = b.op("Squeeze", batch, b.const([0]))
    return CallShapes(
        scatter_at, total, exact, viewed, rows, bound, grouped, flat, eps, kv, head_dim, rep
    )


def _score_shapes(b, kv: int, rep: int, total: str) -> tuple[str, str]:
    """One row's scores by query head group, [kv, rep, -1, total], and back to rows for the
    second MatMul, [kv, -1, total]."""
    grouped = b.op("Concat", b.const([kv, rep, -1]), total, axis=0)
    return grouped, b.op("Concat", b.const([kv, -1]), total, axis=0)


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
        row_mask = b.op("Gather", mask, b.const(0), axis=0)
        row = _row(b, keys, values, q_row, row_mask, (a.grouped, a.flat))
        lone = b.op("Unsqueeze", row, b.const([0]))
    in_place = helper.make_graph(nodes, f"layer{i}_in_place", [], [_any(lone)])
    with b.branch() as nodes:
        viewed = b.op(
            "If",
            a.viewed,
            then_branch=_viewed_rows(b, i, 0, q, a, mask),
            else_branch=_each_row(b, i, q, keys, values, a, mask),
        )
    batch = helper.make_graph(nodes, f"layer{i}_batch", [], [_any(viewed)])
    return b.op("If", a.exact, then_branch=in_place, else_branch=batch)


def _no_rows(b, q: str, name: str):
    """A branch whose output is no rows of context, [0, kv, rep * S, hd]."""
    with b.branch() as nodes:
        empty = b.op("Slice", q, b.const([0]), b.const([0]), b.const([0]))
    return helper.make_graph(nodes, name, [], [_any(empty)])


def _viewed_rows(b, i: int, row: int, q: str, a: CallShapes, mask: str):
    """A branch that attends rows `row`.. of the call through their row views (each a lone
    row's ops on its own [length, kv, hd]), the next row in an If of its own so that a call
    runs as many as it has; its output stacks them, [rows - row, kv, rep * S, hd]. The views
    alias the caches this call's keys and values are scattered into; they are read inside the
    If that also reads the scattered caches (`attend`), so after the scatters."""
    by_position = b.const([-1, a.kv, a.head_dim])
    with b.branch() as nodes:
        views = [row_view(f"past_key_values.{i}.{kind}", row) for kind in ("key", "value")]
        keys, values = (b.op("Reshape", view, by_position) for view in views)
        length = b.op("Shape", views[0], start=1, end=2)
        row_mask = b.op("Gather", mask, b.const(row), axis=0)  # [1, 1, S, total]
        row_mask = b.op("Slice", row_mask, b.const([0]), length, b.const([-1]))
        row_q = b.op("Gather", q, b.const(row), axis=0)
        shapes = _score_shapes(b, a.kv, a.rep, length)
        stacked = b.op("Unsqueeze", _row(b, keys, values, row_q, row_mask, shapes), b.const([0]))
        if row + 1 < VIEW_ROWS:
            more = b.op("Greater", a.rows, b.const(row + 1))
            rest = b.op(
                "If",
                more,
                then_branch=_viewed_rows(b, i, row + 1, q, a, mask),
                else_branch=_no_rows(b, q, f"layer{i}_after_row{row}"),
            )
            stacked = b.op("Concat", stacked, rest, axis=0)
    return helper.make_graph(nodes, f"layer{i}_row{row}_viewed", [], [_any(stacked)])


def _each_row(b, i: int, q: str, keys: str, values: str, a: CallShapes, mask: str):
    """The Loop's branch: a Loop over the rows, each row's positions sliced out of the flattened
    [B * bound, kv, hd] buffer, then the lone row's ops; its scan output stacks the rows."""
    row_index, go_on = f"layer{i}_row", f"layer{i}_go_on"
    with b.branch() as body:
        start = b.op("Mul", b.op("Unsqueeze", row_index, b.const([0])), a.bound)
        end, first = b.op("Add", start, a.total), b.const([0])
        row_keys = b.op("Slice", keys, start, end, first)
        row_values = b.op("Slice", values, start, end, first)
        row_q = b.op("Gather", q, row_index, axis=0)
        row_mask = b.op("Gather", mask, row_index, axis=0)
        row = _row(b, row_keys, row_values, row_q, row_mask, (a.grouped, a.flat))
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


def _row(b, keys: str, values: str, q: str, mask: str, shapes: tuple[str, str]) -> str:
    """One row's attention: keys and values [T, kv, hd] (each kv head's a strided matrix that
    the fused MatMul reads in place), q [kv, rep * S, hd], mask [1, 1, S, T], shapes its
    scores' (`_score_shapes` at T); returns the context [kv, rep * S, hd]."""
    grouped, flat = shapes
    if b.cache != TensorProto.FLOAT:  # kept at half size, computed with in float32
        keys = b.op("Cast", keys, to=TensorProto.FLOAT)
        values = b.op("Cast", values, to=TensorProto.FLOAT)
    scores = b.op("MatMul", q, b.op("Transpose", keys, perm=[1, 2, 0]))  # [kv, rep * S, T]
    scores = softcap(b, b.op("Reshape", scores, grouped), b.family.attention_softcap())
    probs = b.op("Softmax", b.op("Add", scores, mask), axis=-1)
    values = b.op("Transpose", values, perm=[1, 0, 2])  # [kv, T, hd]
    return b.op("MatMul", b.op("Reshape", probs, flat), values)


def _any(name: str):
    """A branch or body output: float, its shape left to the run."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def softcap(b, x: str, cap: float | None) -> str:
    """tanh(x / cap) * cap where the family caps (Gemma 2), x itself where not."""
    if cap is None:
        return x
    scaled = b.op("Tanh", b.op("Div", x, b.const(cap, np.float32)))
    return b.op("Mul", scaled, b.const(cap, np.float32))
