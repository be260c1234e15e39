"""Per-role weight precision: what a role's weights are stored and computed as.

Decoding on a CPU streams every weight once per step, so bytes per weight set the speed. The
draft's precision changes only how often its guesses are accepted, never the output; the
target's precision changes the output itself (it is then exact against the quantized target).

int8/int4 are weight-only, through ONNX Runtime's own block quantizer, tensor by tensor as the
graph is written (see projections): every projection becomes MatMulNBits (symmetric blocks
along the input dimension). Two tensors get a deliberate choice:
- the LM head of a tied model shares the embedding matrix; it is the largest single weight
  (136 M of the 0.5B draft's parameters), read in full every step, so it gets its own
  quantized copy;
- the embedding is not re-quantized: a Gather reads one row per token, so its size costs disk
  and page cache, not time, and re-quantizing it would only add error. It stays float32, or,
  from a GGUF, the file's own blocks where its type has an exact form (the same values in a
  sixth to a third of the bytes; see projections).

gguf (a GGUF source only) keeps the file's own quantized blocks: each projection runs the blocks
it was dequantized from, so the target is exactly the model llama.cpp runs (see gguf_blocks).
Weights whose GGUF type has no exact form take the int4 path above, and the build says so.

fp16 converts the whole float32 graph once it is written (cache and logits included) with ONNX
Runtime's converter; it is meant for GPU execution providers, and on CPU it is slower than
float32. Normalisation ops stay float32 because squaring activations overflows half precision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper

from specrt.bundle import QUANTIZED
from specrt.errors import SpecrtError
from specrt.exporter.external_data import ExternalData
from specrt.sources import Source

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")
CACHES = ("float32", "float16")  # what keys and values are kept in (graph.CACHE_TYPES)
# Defaults measured fastest on a 2-core AVX-512 VNNI box (see docs/precision.md).
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
    cache: str = "float32"  # an fp16 graph keeps an fp16 cache whatever this says

    def __post_init__(self) -> None:
        if self.weights not in PRECISIONS:
            raise SpecrtError(f"precision {self.weights!r} is not one of {', '.join(PRECISIONS)}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise SpecrtError(f"block size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise SpecrtError(f"accuracy level must be 0..4, got {self.accuracy_level}")
        if self.cache not in CACHES:
            raise SpecrtError(f"KV cache type {self.cache!r} is not one of {', '.join(CACHES)}")

    @property
    def converted(self) -> bool:
        """Whether the graph differs from the float32 one (its weights or its cache)."""
        return self.weights != "fp32" or self.kv_cache != "float32"

    @property
    def kv_cache(self) -> str:
        """The type the graph keeps keys and values in."""
        return "float16" if self.weights == "fp16" else self.cache

    @property
    def quantized(self) -> bool:
        return self.weights in QUANTIZED

    def as_dict(self) -> dict:
        record = {"weights": self.weights}
        if self.cache != "float32":
            record["cache"] = self.cache
        if self.weights == "gguf":
            record.update(
                accuracy_level=self.accuracy_level,
                method="the GGUF file's own blocks as MatMulNBits (exact); int4 with block_size "
                "where a type has no exact form",
                block_size=self.block_size,
            )
        elif self.quantized:
            record.update(
                asdict(self),
                lm_head=self.weights,
                method="MatMulNBits, symmetric, weight-only",
            )
        elif self.weights == "fp16":
            record.update(io="fp16", kept_float32=FP16_KEPT_FLOAT32)
        return record


def default_weights(role: str, spec: str, tensorrt: bool = False) -> str:
    """What `specrt build` gives a role it is told nothing of: an int4 draft (its precision
    moves only acceptance, and int4 drafts fastest), and a target from a GGUF file as the
    file's own blocks (the model the user chose, as llama.cpp runs it; float32 would be four to
    eight times the bytes), float32 from any other source. TensorRT builds take float32
    graphs (the engine has a precision of its own)."""
    if tensorrt:
        return "fp32"
    if role == "draft":
        return "int4"
    return "gguf" if Source.parse(spec).kind == "gguf" else "fp32"


def convert_float16(source: Path, out_dir: Path) -> None:
    """Write out_dir/model.onnx(+.data) in fp16 from a float32 graph (the whole graph is
    converted at once: fp16 is for GPU execution providers, see the module docstring)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(
        onnx.load(str(source)),
        keep_io_types=False,
        disable_shape_infer=True,
        op_block_list=FP16_KEPT_FLOAT32,
    )
    save_aligned(model, out_dir)


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
