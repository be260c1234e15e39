"""How a weight matrix becomes graph nodes at a role's precision, one tensor at a time.

The graph writer asks for `linear(b, x, source, name)` (x @ W^T for the Linear weight `source`)
and `head(b, x, ...)` (the vocabulary projection); each precision reads its tensor in bands of
output rows, converts the band and writes it straight into the side file, so no step holds a
model, only one band of one matrix beside its converted form:

- float32: MatMul on W^T (the head as Gemm(transB) on W, so it streams by rows too);
- int8/int4: MatMulNBits, symmetric blocks along the inputs, quantized by ONNX Runtime's own
  block quantizer column by column (each output is quantized on its own, so band by band gives
  the very bytes a whole-matrix pass would);
- gguf: MatMulNBits over the GGUF file's own blocks (see gguf_blocks), each band checked against
  the file's dequantized floats; a float tensor stays float32 and a type with no exact form is
  quantized to int4 as above, and `forms` records which weight took which road.

`embedding(b, source)` writes the token lookup: a Gather over the float32 table, except where a
quantized role reads a GGUF whose embedding type has an exact form. There the table stays in
the file's blocks (values, a scale per block, offsets per 16 or 32) and only the gathered rows are
dequantized, by the same float32 operations as `Blocks.dequantize`: the same numbers as the
float32 table, in a sixth to a third of its bytes (the default target's 933 MB table: 175 MB).
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.gguf_blocks import Blocks
from specrt.exporter.precision import Precision

# Float rounding of the scales (d*sc, and the offsets' c*d - m) is all that may differ.
EXACT_RELATIVE_TOLERANCE = 1e-5
FLOAT_KINDS = ("F32", "F16", "BF16")
EMBEDDED = "embedded_tokens"  # the table's rows for input_ids, before a family scales them


class FloatProjections:
    """float32 weights, as the source holds them (after dequantization, for a GGUF)."""

    def __init__(self) -> None:
        self.forms: dict[str, str] = {}
        self.embedding_form = "fp32"

    def embedding(self, b, source: str) -> tuple[str, str | None]:
        """The rows of the embedding table `source` for `input_ids` ([B, S, hidden]), and the
        float32 table a tied head shares (None where there is none)."""
        table = b.weight_bands("embed_tokens.weight", source)
        return b.op("Gather", table, "input_ids", out=EMBEDDED), table

    def linear(self, b, x: str, source: str, name: str) -> str:
        weight = b.tensors.get(source)
        return b.op("MatMul", x, b.weight(f"{name}.weight_t", np.ascontiguousarray(weight.T)))

    def head(self, b, x: str, source: str, table: str | None) -> str:
        """Logits [B, n, vocab] from the last hidden states: Gemm(transB) over the [vocab,
        hidden] table (the embedding's own initializer, `table`, when the model ties them)."""
        if table is None:
            table = b.weight_bands("lm_head.weight", source)
        hidden, vocab = b.tensors.config.hidden_size, b.tensors.shape(source)[0]
        flat = b.op("Reshape", x, b.const([-1, hidden]))
        logits = b.op("Gemm", flat, table, transB=1)
        return b.op("Reshape", logits, b.op("Concat", b.batch, b.const([-1, vocab]), axis=0))


class QuantizedProjections(FloatProjections):
    """int8/int4 MatMulNBits, symmetric, weight-only; the head gets its own quantized copy (a
    tied model's embedding stays float32 for the Gather)."""

    def __init__(self, bits: int, block_size: int, accuracy_level: int) -> None:
        super().__init__()
        self.bits, self.block_size, self.accuracy_level = bits, block_size, accuracy_level

    def linear(self, b, x: str, source: str, name: str) -> str:
        return self.quantized(b, x, source, name)

    def head(self, b, x: str, source: str, table: str | None) -> str:
        return self.linear(b, x, source, "lm_head")

    def embedding(self, b, source: str) -> tuple[str, str | None]:
        """The file's own blocks where the source is a GGUF whose embedding type has an exact
        form (the head, quantized on its own, needs no float32 table); float32 otherwise."""
        form = b.tensors.blocks(source, slice(0, 1))
        if form is None:
            return super().embedding(b, source)
        self.embedding_form = f"{form.form}, gathered"
        return _gathered_blocks(b, source, form), None

    def quantized(self, b, x: str, source: str, name: str) -> str:
        outputs, inputs = b.tensors.shape(source)
        bands = (self._quantize(rows) for _, rows in b.tensors.bands(source))
        packed, scales = _split_bands(b, bands, f"{name}.weight_t_Q{self.bits}")
        shape = (inputs, outputs, self.bits, self.block_size)
        return _matmul_nbits(b, x, packed, scales, shape, self.accuracy_level)

    def _quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n outputs, K] float32 -> (packed uint8 [n, K/block, bytes], scales [n, K/block]);
        the quantizer pads K up to whole blocks, as MatMulNBits expects."""
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(
            block_size=self.block_size, is_symmetric=True, bits=self.bits
        )
        packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
            np.ascontiguousarray(rows.T)
        )
        return packed, scales


class GgufProjections(QuantizedProjections):
    """The GGUF file's own blocks where they have an exact form; int4 where they do not."""

    def __init__(self, block_size: int, accuracy_level: int) -> None:
        super().__init__(4, block_size, accuracy_level)
        self.sums: dict[tuple[str, int], str] = {}  # (x, span) -> its sums (q/k/v share them)

    def linear(self, b, x: str, source: str, name: str) -> str:
        kind = b.tensors.kind(source)
        key = f"{name}.weight_t"
        if kind in FLOAT_KINDS:
            self.forms[key] = f"{kind} kept as float32"
            return FloatProjections.linear(self, b, x, source, name)
        form = b.tensors.blocks(source, slice(0, 1))  # the first row: the tensor's form
        if form is None:
            self.forms[key] = f"{kind} re-quantized to int4 (no exact form)"
            return self.quantized(b, x, source, name)
        self.forms[key] = form.form
        return self._blocks(b, x, source, name, form)

    def _blocks(self, b, x: str, source: str, name: str, form: Blocks) -> str:
        outputs, inputs = b.tensors.shape(source)
        offsets: list[np.ndarray] = []

        def bands():
            for start, rows in b.tensors.bands(source):
                blocks = b.tensors.blocks(source, slice(start, start + len(rows)))
                _check_exact(blocks, rows, source)
                if blocks.offsets is not None:
                    offsets.append(blocks.offsets)
                yield blocks.packed(), blocks.scales

        base = f"gguf.{name}.weight_t"
        packed, scales = _split_bands(b, bands(), f"{base}.B")
        shape = (inputs, outputs, form.bits, form.block_size)
        product = _matmul_nbits(b, x, packed, scales, shape, self.accuracy_level)
        if not offsets:
            return product
        table = b.weight(f"{base}.offsets", np.hstack(offsets))  # [K/span, N]
        shift = b.op("MatMul", self._sums(b, x, inputs, form.span), table)
        return b.op("Sub", product, shift)

    def _sums(self, b, x: str, inputs: int, span: int) -> str:
        """[..., K] -> sums over each `span` inputs [..., K/span], whatever the rank; once per
        x and span."""
        if (x, span) not in self.sums:
            lead = b.op("Shape", x, end=-1)
            shape = b.op("Concat", lead, b.const([inputs // span, span]), axis=0)
            grouped = b.op("Reshape", x, shape)
            self.sums[x, span] = b.op("ReduceSum", grouped, b.const([-1]), keepdims=0)
        return self.sums[x, span]


def _gathered_blocks(b, source: str, form: Blocks) -> str:
    """Embedding rows for `input_ids` from a table kept in the GGUF's blocks: the values
    (4-bit pairs packed low first, as MatMulNBits takes them), a scale per block and the
    offsets per span of inputs are gathered per token, then dequantized as Blocks.dequantize does:
    (value - centre) * scale - offset, in float32, so the rows equal the float32 table's."""
    inputs = b.tensors.shape(source)[1]
    scales: list[np.ndarray] = []
    offsets: list[np.ndarray] = []

    def bands():
        for start, rows in b.tensors.bands(source):
            blocks = b.tensors.blocks(source, slice(start, start + len(rows)))
            _check_exact(blocks, rows, source)
            scales.append(blocks.scales)
            if blocks.offsets is not None:
                offsets.append(blocks.offsets.T)
            yield blocks.packed().reshape(len(rows), -1)

    base = "gguf.embed_tokens"
    values = b.op("Gather", b.weight_from_bands(f"{base}.values", bands()), "input_ids")
    if form.bits == 4:
        low = b.op("BitwiseAnd", values, b.const(0x0F, np.uint8))
        high = b.op("BitShift", values, b.const(4, np.uint8), direction="RIGHT")
        pairs = [b.op("Unsqueeze", half, b.const([-1])) for half in (low, high)]
        values = b.op("Concat", *pairs, axis=-1)
    centred = b.op("Sub", b.op("Cast", values, to=1), b.const(2 ** (form.bits - 1), np.float32))
    lead = b.op("Shape", "input_ids")

    def per(block: int, x: str) -> str:  # [B, S, ...] -> [B, S, K / block, block]
        return b.op("Reshape", x, b.op("Concat", lead, b.const([inputs // block, block]), axis=0))

    def gathered(name: str, table: list[np.ndarray]) -> str:
        rows = b.op("Gather", b.weight(f"{base}.{name}", np.vstack(table)), "input_ids")
        return b.op("Unsqueeze", rows, b.const([-1]))

    rows = b.op("Mul", per(form.block_size, centred), gathered("scales", scales))
    if offsets:
        rows = b.op("Sub", per(form.span, rows), gathered("offsets", offsets))
    return b.op("Reshape", rows, b.op("Concat", lead, b.const([inputs]), axis=0), out=EMBEDDED)


def _matmul_nbits(b, x: str, packed: str, scales: str, shape: tuple, level: int) -> str:
    """x @ W for W in MatMulNBits blocks; shape is (K inputs, N outputs, bits, block size)."""
    inputs, outputs, bits, block_size = shape
    return b.op(
        "MatMulNBits",
        x,
        packed,
        scales,
        domain="com.microsoft",
        K=inputs,
        N=outputs,
        bits=bits,
        block_size=block_size,
        accuracy_level=level,
    )


def _split_bands(b, bands, name: str) -> tuple[str, str]:
    """Write (packed, scales) bands as MatMulNBits' two initializers, `name` (packed
    uint8 [N, blocks, bytes]) and `name.scales` (float32 [N * blocks]): the packed bands stream
    to the side file, the scales (an eighth of the packed bytes at most) are written after."""
    scales: list[np.ndarray] = []

    def packed_bands():
        for packed, band_scales in bands:
            scales.append(np.asarray(band_scales, np.float32).reshape(-1))
            yield packed

    packed = b.weight_from_bands(name, packed_bands())
    return packed, b.weight(f"{name}.scales", np.concatenate(scales))


def _check_exact(blocks: Blocks, want: np.ndarray, name: str) -> None:
    """want is the source's float32 rows [n, K]; the blocks must reproduce them."""
    if blocks.values.shape != want.shape:
        raise SpecrtError(f"GGUF {name}: blocks of shape {blocks.values.shape}, rows {want.shape}")
    error = float(np.abs(blocks.dequantize() - want).max())
    bound = EXACT_RELATIVE_TOLERANCE * max(1.0, float(np.abs(want).max()))
    if error > bound:
        raise SpecrtError(
            f"GGUF {name} ({blocks.kind}): its blocks differ from the file's dequantized weight "
            f"by {error:.3g} (bound {bound:.3g}); refusing to call the result exact"
        )


def projections_for(precision: Precision) -> FloatProjections:
    """How a graph at this precision writes its weights (fp16 is written as float32 first)."""
    if precision.weights == "gguf":
        return GgufProjections(precision.block_size, precision.accuracy_level)
    if precision.weights in ("int8", "int4"):
        bits = 8 if precision.weights == "int8" else 4
        return QuantizedProjections(bits, precision.block_size, precision.accuracy_level)
    return FloatProjections()
