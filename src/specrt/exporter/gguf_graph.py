"""Put a GGUF file's own quantized blocks into the float32 graph exported from it.

The float32 graph holds the GGUF weights dequantized; this swaps each projection's MatMul for a
MatMulNBits over the very blocks it came from (see gguf_blocks), so the `gguf` precision runs the
model llama.cpp runs from the same file. Every converted weight is checked against the float32
weight it replaces before the graph is written: a tensor that does not reproduce it (a layout this
code does not know) stops the build instead of shipping a different model under an exact name.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specrt.errors import SpecrtError
from specrt.exporter.gguf_blocks import SUMS_BLOCK, SUPPORTED, Blocks, permuted, row_permutation
from specrt.exporter.gguf_blocks import to_blocks as blocks_of

FLOAT_TYPES = ("F32", "F16", "BF16")
PROJECTIONS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LAYER_WEIGHT = re.compile(r"layers\.(\d+)\.(.+)\.weight_t$")
# Float rounding of the scales (d*sc, and the offsets' c*d - m) is all that may differ.
RELATIVE_TOLERANCE = 1e-5


class GgufWeights:
    """The quantized tensors of one GGUF file, by the name the exported graph gives them."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(path)
        except (OSError, ValueError) as err:
            raise SpecrtError(f"{path}: cannot read it as GGUF: {err}") from err
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self._field("general.architecture")
        self.heads = int(self._field(f"{self.architecture}.attention.head_count"))
        kv = self.reader.fields.get(f"{self.architecture}.attention.head_count_kv")
        self.kv_heads = int(kv.contents()) if kv is not None else self.heads

    def _field(self, key: str):
        field = self.reader.fields.get(key)
        if field is None:
            raise SpecrtError(f"{self.path}: GGUF metadata has no {key}")
        return field.contents()

    def source_name(self, initializer: str) -> str | None:
        """The GGUF tensor behind a graph weight, or None for weights that are not projections."""
        if initializer == "lm_head.weight_t":
            return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        match = LAYER_WEIGHT.match(initializer)
        if match is None or match.group(2) not in PROJECTIONS:
            return None
        return f"blk.{match.group(1)}.{PROJECTIONS[match.group(2)]}.weight"

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def blocks(self, name: str, inputs: int) -> Blocks:
        """The tensor's blocks, rows in the order transformers loads them."""
        blocks = blocks_of(self.kind(name), np.asarray(self.tensors[name].data), inputs)
        if self.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.heads if ".attn_q." in name else self.kv_heads
            blocks = permuted(blocks, row_permutation(blocks.values.shape[0], heads))
        return blocks


def use_gguf_blocks(
    model: onnx.ModelProto, weights: GgufWeights, accuracy_level: int, log: Callable[[str], None]
) -> tuple[dict[str, str], list[str]]:
    """Rewrite model in place; return (form per graph weight, names of MatMul nodes left for
    the int4 quantizer because their GGUF type has no exact form)."""
    initializers = {t.name: t for t in model.graph.initializer}
    replaced: set[str] = set()  # float weights the blocks stand in for
    forms: dict[str, str] = {}
    leftover: list[str] = []
    sums: dict[str, str] = {}  # one per distinct input: q/k/v and gate/up share theirs
    nodes = []
    for node in model.graph.node:
        name = weights.source_name(node.input[1]) if node.op_type == "MatMul" else None
        if name is None or node.input[1] not in initializers:
            nodes.append(node)
            continue
        kind = weights.kind(name)
        if kind in FLOAT_TYPES:
            forms[node.input[1]] = f"{kind} kept as float32"
            nodes.append(node)
        elif kind not in SUPPORTED:
            forms[node.input[1]] = f"{kind} re-quantized to int4 (no exact form)"
            leftover.append(node.name)
            nodes.append(node)
        else:
            weight = numpy_helper.to_array(initializers[node.input[1]])
            replaced.add(node.input[1])
            blocks = weights.blocks(name, weight.shape[0])
            _check_exact(blocks, weight, name)
            forms[node.input[1]] = blocks.form
            nodes += _matmul_nbits(node, blocks, accuracy_level, sums, model.graph.initializer)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [t for t in model.graph.initializer if t.name not in replaced]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    for form, count in sorted(Counter(forms.values()).items()):
        log(f"  {count} x {form}")
    return forms, leftover


def _check_exact(blocks: Blocks, weight: np.ndarray, name: str) -> None:
    """weight is the graph's [K, N] float32 copy; the blocks must reproduce it."""
    want = weight.T
    if blocks.values.shape != want.shape:
        raise SpecrtError(f"GGUF {name}: shape {blocks.values.shape}, the graph has {want.shape}")
    error = float(np.abs(blocks.dequantize() - want).max())
    bound = RELATIVE_TOLERANCE * max(1.0, float(np.abs(want).max()))
    if error > bound:
        raise SpecrtError(
            f"GGUF {name} ({blocks.kind}): its blocks differ from the model's dequantized weight "
            f"by {error:.3g} (bound {bound:.3g}); refusing to call the result exact"
        )


def _matmul_nbits(
    node, blocks: Blocks, accuracy_level: int, sums: dict[str, str], initializers
) -> list:
    """MatMulNBits over the blocks, minus (sums of each 32 inputs) @ offsets where there are any."""
    x, out, base = node.input[0], node.output[0], f"gguf.{node.input[1]}"
    n, k = blocks.values.shape
    initializers.extend(
        [
            numpy_helper.from_array(blocks.packed(), f"{base}.B"),
            numpy_helper.from_array(blocks.scales.reshape(-1), f"{base}.scales"),
        ]
    )
    product = out if blocks.offsets is None else f"{base}.product"
    made = [
        helper.make_node(
            "MatMulNBits",
            [x, f"{base}.B", f"{base}.scales"],
            [product],
            name=f"{base}.MatMulNBits",
            domain="com.microsoft",
            K=k,
            N=n,
            bits=blocks.bits,
            block_size=blocks.block_size,
            accuracy_level=accuracy_level,
        )
    ]
    if blocks.offsets is None:
        return made
    if x not in sums:  # [..., K] -> [..., K/32, 32] -> sums [..., K/32], whatever the rank
        sums[x] = f"gguf.sums.{len(sums)}"
        grouped, axis = f"{sums[x]}.grouped", f"{sums[x]}.axis"
        initializers.extend(
            [
                numpy_helper.from_array(np.array([k // SUMS_BLOCK, SUMS_BLOCK]), grouped),
                numpy_helper.from_array(np.array([-1]), axis),
            ]
        )
        made += [
            helper.make_node("Shape", [x], [f"{sums[x]}.lead"], name=f"{sums[x]}.lead", end=-1),
            helper.make_node(
                "Concat",
                [f"{sums[x]}.lead", grouped],
                [f"{sums[x]}.shape"],
                name=f"{sums[x]}.c",
                axis=0,
            ),
            helper.make_node(
                "Reshape", [x, f"{sums[x]}.shape"], [f"{sums[x]}.blocks"], name=f"{sums[x]}.r"
            ),
            helper.make_node(
                "ReduceSum", [f"{sums[x]}.blocks", axis], [sums[x]], name=sums[x], keepdims=0
            ),
        ]
    initializers.append(numpy_helper.from_array(blocks.offsets, f"{base}.offsets"))
    made += [
        helper.make_node(
            "MatMul", [sums[x], f"{base}.offsets"], [f"{base}.shift"], name=f"{base}.mm"
        ),
        helper.make_node("Sub", [product, f"{base}.shift"], [out], name=f"{base}.sub"),
    ]
    return made
