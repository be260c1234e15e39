"""Per-role weight precision: turn a checked float32 graph into an fp16, int8 or int4 one.

Decoding on a CPU streams every weight once per step, so bytes per weight set the speed. The
draft's precision changes only how often its guesses are accepted, never the output; the
target's precision changes the output itself (it is then exact against the quantized target).

int8/int4 are weight-only, through ONNX Runtime's own quantizer: every MatMul with a constant
weight becomes MatMulNBits (symmetric blocks along the input dimension). Two tensors get a
deliberate choice:
- the LM head of a tied model shares the embedding matrix through Gemm(transB); it is the largest
  single weight (136 M of the 0.5B draft's parameters), read in full every step, so it gets its
  own transposed copy as a MatMul that is quantized like the rest;
- the embedding stays float32: a Gather reads one row per token, so its size costs disk and
  page cache, not time, and quantizing it would only add error.

gguf (a GGUF source only) keeps the file's own quantized blocks: each projection runs the blocks
it was dequantized from, so the target is exactly the model llama.cpp runs (see gguf_blocks).
Weights whose GGUF type has no exact form take the int4 path above, and the build says so.

fp16 converts the whole graph (cache and logits included) with ONNX Runtime's converter; it is
meant for GPU execution providers, and on CPU it is slower than float32. Normalisation ops stay
float32 because squaring activations overflows half precision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specrt.bundle import QUANTIZED
from specrt.errors import SpecrtError
from specrt.exporter.gguf_graph import GgufWeights, use_gguf_blocks
from specrt.exporter.graph import ExternalData

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")
# Defaults measured fastest on a 2-core AVX-512 VNNI box (see README, "Precision").
DEFAULT_BLOCK_SIZE = 128
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations: the VNNI kernels
FP16_KEPT_FLOAT32 = ["Pow", "ReduceMean", "Sqrt", "Div"]
INLINE_LIMIT = 1024  # bytes; larger initializers go to the aligned side file


@dataclass(frozen=True)
class Precision:
    """What a role's weights are stored and computed as; recorded in the manifest."""

    weights: str = "fp32"
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL

    def __post_init__(self) -> None:
        if self.weights not in PRECISIONS:
            raise SpecrtError(f"precision {self.weights!r} is not one of {', '.join(PRECISIONS)}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise SpecrtError(f"block size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise SpecrtError(f"accuracy level must be 0..4, got {self.accuracy_level}")

    @property
    def quantized(self) -> bool:
        return self.weights in QUANTIZED

    def as_dict(self) -> dict:
        record = {"weights": self.weights}
        if self.weights == "gguf":
            record.update(
                accuracy_level=self.accuracy_level,
                embedding="fp32",
                method="the GGUF file's own blocks as MatMulNBits (exact); int4 with block_size "
                "where a type has no exact form",
                block_size=self.block_size,
            )
        elif self.quantized:
            record.update(
                asdict(self),
                lm_head=self.weights,
                embedding="fp32",
                method="MatMulNBits, symmetric, weight-only",
            )
        elif self.weights == "fp16":
            record.update(io="fp16", kept_float32=FP16_KEPT_FLOAT32)
        return record


def convert_graph(
    source: Path,
    out_dir: Path,
    precision: Precision,
    gguf: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Write out_dir/model.onnx(+.data) at `precision` from a float32 graph; return what the
    manifest records beyond the precision itself (the form of each weight, for gguf)."""
    model = onnx.load(str(source))
    record: dict = {}
    if precision.weights == "gguf":
        if gguf is None:
            raise SpecrtError(
                "precision gguf needs a GGUF source (a .gguf file or a registry name)"
            )
        _untie_head(model)
        forms, leftover = use_gguf_blocks(model, GgufWeights(gguf), precision.accuracy_level, log)
        if leftover:
            log(f"  {len(leftover)} weights have no exact form: re-quantized to int4 as before")
            model = _quantize(model, precision, leftover)
        record["tensors"] = forms
    elif precision.quantized:
        _untie_head(model)
        model = _quantize(model, precision)
    elif precision.weights == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(
            model, keep_io_types=False, disable_shape_infer=True, op_block_list=FP16_KEPT_FLOAT32
        )
    else:
        raise SpecrtError("a float32 graph needs no conversion")
    save_aligned(model, out_dir)
    return record


def _quantize(
    model: onnx.ModelProto, precision: Precision, nodes: list[str] | None = None
) -> onnx.ModelProto:
    """int8/int4 weight-only, on every constant-weight MatMul or only the named nodes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs one INFO line per node
    try:
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=8 if precision.weights == "int8" else 4,
            nodes_to_include=nodes,
            block_size=precision.block_size,
            is_symmetric=True,
            accuracy_level=precision.accuracy_level,
        )
        quantizer.process()
    finally:
        logger.setLevel(level)
    return quantizer.model.model


def _untie_head(model: onnx.ModelProto) -> None:
    """Replace Gemm(x, E, transB=1) on a shared initializer by MatMul(x, E^T) on its own copy."""
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Gemm" or node.input[1] not in initializers:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs != {"transB": 1} or len(node.input) != 2:
            raise SpecrtError(f"unexpected Gemm {node.name} in the graph; cannot quantize it")
        table = numpy_helper.to_array(initializers[node.input[1]])
        head = numpy_helper.from_array(np.ascontiguousarray(table.T), "lm_head.weight_t")
        model.graph.initializer.append(head)
        node.op_type = "MatMul"
        node.input[1] = head.name
        del node.attribute[:]


def save_aligned(model: onnx.ModelProto, out_dir: Path) -> None:
    """Save with weights in page-aligned external data, as the exporter writes them, so ONNX
    Runtime can memory-map them."""
    with open(out_dir / "model.onnx.data", "wb") as handle:
        data = ExternalData(handle, "model.onnx.data")
        tensors = list(model.graph.initializer)
        del model.graph.initializer[:]
        for tensor in tensors:
            array = numpy_helper.to_array(tensor)
            if array.nbytes > INLINE_LIMIT:
                tensor = data.tensor(tensor.name, array)
            model.graph.initializer.append(tensor)
    onnx.save_model(model, str(out_dir / "model.onnx"))
