"""The decoder graph's inputs and outputs: the names and shapes graph.py's docstring lists,
and the empty defaults that make the row views optional (attention.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from specrt.bundle import VIEW_ROWS, row_view
from specrt.exporter.batched_attention import CACHE_DIMS

if TYPE_CHECKING:
    from specrt.exporter.graph import ModelShape


def graph_inputs(shape: ModelShape, cache_type: int, attention: str) -> tuple[list, list]:
    """The inputs, and the initializers that give the optional ones (the CPU graph's row
    views) their defaults."""
    cache = _cache_dims(shape, attention)
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
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", cache_type, cache)
            )
    if attention != "in_place":
        return inputs, []
    views, defaults = row_views(shape.num_layers, shape.num_kv_heads, shape.head_dim, cache_type)
    return inputs + views, defaults


def graph_outputs(shape: ModelShape, cache_type: int, attention: str) -> list:
    cache = _cache_dims(shape, attention)
    outputs = [
        helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT, ["batch_size", "kept", shape.vocab_size]
        )
    ]
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", cache_type, cache))
    return outputs


def row_views(num_layers: int, kv: int, head_dim: int, cache_type: int) -> tuple[list, list]:
    """Every cache's row views as graph inputs [1, positions, kv, hd], each with an empty
    default ([1, 0, kv, hd], an initializer of the same name), so that a caller who binds none
    (the export check, another tool, TensorRT's parser, which takes them as constants) gets
    the row-by-row Loop."""
    inputs, defaults = [], []
    dtype = helper.tensor_dtype_to_np_dtype(cache_type)
    for row in range(VIEW_ROWS):
        for i in range(num_layers):
            for kind in ("key", "value"):
                name = row_view(f"past_key_values.{i}.{kind}", row)
                inputs.append(
                    helper.make_tensor_value_info(name, cache_type, [1, "positions", kv, head_dim])
                )
                empty = np.zeros((1, 0, kv, head_dim), dtype)
                defaults.append(numpy_helper.from_array(empty, name))
    return inputs, defaults


def _cache_dims(shape: ModelShape, attention: str) -> list:
    """A cache buffer's dims: by position for the CPU graph, by head for a batched one."""
    if attention == "in_place":
        return ["batch_size", "positions", shape.num_kv_heads, shape.head_dim]
    sizes = {"kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    return [sizes.get(dim, dim) for dim in CACHE_DIMS]
