"""Attention kernels ONNX Runtime offers for a decode step over a long cache, measured here.

A graph of attention only (no projections: query, key and value come in as inputs), one layer
per model layer, over a cache bound in place as the CPU engine binds it, in three forms:

- `specrt`: what `exporter/graph.py` writes: new keys and values scattered into a
  [batch, kv_heads, capacity, head_dim] buffer, the buffer sliced to the call's length (a
  copy), each kv head's query heads folded into rows, QKᵀ, an additive mask, softmax, then V.
- `gqa`: ONNX Runtime's fused `com.microsoft.GroupQueryAttention`, its past and present one
  shared buffer (in place, per-row lengths), as ONNX Runtime GenAI's builder emits it.
- `strided`: no copy at all: the cache laid out [batch, capacity, kv_heads, head_dim] and bound
  at exactly the call's length, so each kv head's keys are a strided [length, head_dim] matrix
  that the fused MatMul reads in place (one row only: rows of a batch are not contiguous).

For each: the median decode step at each context length, and whether a verify call of 4 tokens
gives each position bit for bit what 4 one-token calls give (speculation rests on it), and
whether a call of 2 rows x 4 tokens after a past runs (a batched verify).

    python benchmarks/attention_kernels.py [--sizes 1000,4000,8000] [--layers 28 --heads 12
        --kv-heads 2 --head-dim 128] [--out benchmarks/results/cpu-attention-kernels]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from specrt import machine
from specrt.files import write_result

KINDS = ("specrt", "gqa", "strided")
RUNS = 12  # decode steps timed per kind and size


class _Graph:
    def __init__(self):
        self.nodes, self.inits = [], []

    def op(self, op_type, *inputs, out=None, **attrs):
        out = out or f"t{len(self.nodes)}"
        domain = "com.microsoft" if op_type == "GroupQueryAttention" else None
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out

    def const(self, value, dtype=np.int64):
        name = f"c{len(self.inits)}"
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
        return name


def build(kind: str, layers: int, heads: int, kv: int, hd: int) -> onnx.ModelProto:
    """The attention-only graph of one kind (see the module's docstring)."""
    g, f32 = _Graph(), TensorProto.FLOAT
    cache = ["B", "C", kv, hd] if kind == "strided" else ["B", kv, "C", hd]
    inputs = [
        helper.make_tensor_value_info(n, f32, ["B", "S", w * hd])
        for n, w in (("q", heads), ("k", kv), ("v", kv))
    ]
    if kind == "gqa":
        inputs += [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
        ]
    else:
        inputs += [
            helper.make_tensor_value_info("pos", TensorProto.INT64, ["B", "S"]),
            helper.make_tensor_value_info("mask", f32, ["B", 1, "RS", "T"]),
            helper.make_tensor_value_info("total", TensorProto.INT64, [1]),
        ]
    outputs, x = [], "q"
    for i in range(layers):
        names = [f"past.{i}.key", f"past.{i}.value"]
        inputs += [helper.make_tensor_value_info(n, f32, cache) for n in names]
        present = [n.replace("past", "present") for n in names]
        outputs += [helper.make_tensor_value_info(n, f32, cache) for n in present]
        if kind == "gqa":
            g.nodes.append(
                helper.make_node(
                    "GroupQueryAttention",
                    [x, "k", "v", *names, "seqlens_k", "total"],
                    [f"o{i}", *present],
                    domain="com.microsoft",
                    num_heads=heads,
                    kv_num_heads=kv,
                )
            )
            x = f"o{i}"
            continue
        x = _layer(g, kind, x, names, present, heads, kv, hd)
    outputs.insert(0, helper.make_tensor_value_info("out", f32, ["B", "S", heads * hd]))
    g.op("Identity", x, out="out")
    graph = helper.make_graph(g.nodes, kind, inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _layer(g: _Graph, kind, x, names, present, heads, kv, hd) -> str:
    """One layer of the `specrt` or `strided` form; returns its output [B, S, heads * hd]."""
    rep, axis = heads // kv, 1 if kind == "strided" else 2
    shape = [0, 0, kv, hd]
    k, v = g.op("Reshape", "k", g.const(shape)), g.op("Reshape", "v", g.const(shape))
    if kind == "specrt":
        k, v = g.op("Transpose", k, perm=[0, 2, 1, 3]), g.op("Transpose", v, perm=[0, 2, 1, 3])
    at = g.op(
        "Expand",
        g.op("Unsqueeze", "pos", g.const([2, 3] if axis == 1 else [1, 3])),
        g.op("Shape", k),
    )
    keys = g.op("ScatterElements", names[0], at, k, out=present[0], axis=axis)
    values = g.op("ScatterElements", names[1], at, v, out=present[1], axis=axis)
    q = g.op("Reshape", x, g.const([0, 0, kv, rep, hd]))  # [B, S, kv, rep, hd]
    q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 3, 1, 4]), g.const([0, kv, -1, hd]))
    q = g.op("Mul", q, g.const(hd**-0.5, np.float32))  # [B, kv, rep * S, hd]
    if kind == "specrt":
        first, two = g.const([0]), g.const([2])
        keys = g.op("Slice", keys, first, "total", two)
        values = g.op("Slice", values, first, "total", two)
        scores = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2]))
        ctx = g.op("MatMul", g.op("Softmax", g.op("Add", scores, "mask"), axis=-1), values)
    else:  # batch 1: [T, kv, hd] read per kv head as a strided matrix, fused with the MatMul
        three = g.const([-1, kv, hd])
        keys, values = g.op("Reshape", keys, three), g.op("Reshape", values, three)
        q3 = g.op("Reshape", q, g.const([kv, -1, hd]))
        scores = g.op("MatMul", q3, g.op("Transpose", keys, perm=[1, 2, 0]))
        scores = g.op("Unsqueeze", scores, g.const([0]))
        probs = g.op("Squeeze", g.op("Softmax", g.op("Add", scores, "mask"), axis=-1), g.const([0]))
        ctx = g.op(
            "Unsqueeze",
            g.op("MatMul", probs, g.op("Transpose", values, perm=[1, 0, 2])),
            g.const([0]),
        )
    ctx = g.op(
        "Transpose", g.op("Reshape", ctx, g.const([0, kv, rep, -1, hd])), perm=[0, 3, 1, 2, 4]
    )
    return g.op("Reshape", ctx, g.const([0, 0, heads * hd]))


class Kernel:
    """One form's session over caches of `rows` slots, bound in place as the CPU engine does."""

    def __init__(self, kind: str, dims: dict, capacity: int, rows: int, folder: Path):
        self.kind, self.dims, self.capacity = kind, dims, capacity
        path = folder / f"{kind}.onnx"
        onnx.save(build(kind, **dims), str(path))
        options = ort.SessionOptions()
        options.add_session_config_entry("session.force_spinning_stop", "1")  # as the engine
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        kv, hd = dims["kv"], dims["hd"]
        shape = [rows, capacity, kv, hd] if kind == "strided" else [rows, kv, capacity, hd]
        rng = np.random.default_rng(0)  # filled: every page of the context really read
        self.caches = [
            rng.standard_normal(shape, np.float32) * 0.5 for _ in range(2 * dims["layers"])
        ]

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths: list[int]) -> np.ndarray:
        rows, width = q.shape[:2]
        total = max(lengths) + width
        bind = self.session.io_binding()
        bind.bind_output("out")
        for name, value in (("q", q), ("k", k), ("v", v), *self._lengths(lengths, width)):
            bind.bind_cpu_input(name, value)
        kv, hd, positions = self.dims["kv"], self.dims["hd"], self.capacity
        if self.kind == "strided":  # bound at exactly the call's length: nothing to slice
            positions = total
        for j, buffer in enumerate(self.caches):
            name = f"past.{j // 2}.{('key', 'value')[j % 2]}"
            shape = (
                [rows, positions, kv, hd] if self.kind == "strided" else [rows, kv, positions, hd]
            )
            for bind_at, bound in (
                (bind.bind_input, name),
                (bind.bind_output, name.replace("past", "present")),
            ):
                bind_at(bound, "cpu", 0, np.float32, shape, buffer.ctypes.data)
        self.session.run_with_iobinding(bind)
        return bind.get_outputs()[0].numpy()

    def _lengths(self, lengths: list[int], width: int) -> list[tuple[str, np.ndarray]]:
        total = max(lengths) + width
        if self.kind == "gqa":
            seqlens = np.asarray([n + width - 1 for n in lengths], np.int32)
            return [("seqlens_k", seqlens), ("total", np.asarray(total, np.int32))]
        pos = np.asarray(lengths)[:, None] + np.arange(width)
        allowed = np.arange(total)[None, None, :] <= pos[:, :, None]
        mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
        mask = np.tile(mask, (1, 1, self.dims["heads"] // self.dims["kv"], 1))
        return [("pos", pos.astype(np.int64)), ("mask", mask), ("total", np.asarray([total]))]


def _inputs(dims: dict, rows: int, width: int, rng) -> tuple[np.ndarray, ...]:
    heads, kv, hd = dims["heads"], dims["kv"], dims["hd"]
    q = rng.standard_normal((rows, width, heads * hd), np.float32)
    k = rng.standard_normal((rows, width, kv * hd), np.float32)
    return q, k, rng.standard_normal((rows, width, kv * hd), np.float32)


def verify_gap(kernel: Kernel, rng, past: int = 300, width: int = 4) -> float:
    """max |difference| between a verify call of `width` tokens and `width` one-token calls."""
    q, k, v = _inputs(kernel.dims, 1, width, rng)
    whole = kernel.run(q, k, v, [past])
    steps = [
        kernel.run(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], [past + i])
        for i in range(width)
    ]
    return float(np.abs(whole - np.concatenate(steps, axis=1)).max())


def batched_verify(kernel: Kernel, rng) -> str:
    """Whether 2 rows x 4 tokens after a past run: 'runs', or the kernel's refusal."""
    if kernel.kind == "strided":
        return "one row only (a batch's rows are not contiguous at the call's length)"
    try:
        kernel.run(*_inputs(kernel.dims, 2, 4, rng), [300, 200])
    except Exception as err:  # ONNX Runtime's own error types
        return str(err).split("Status Message: ")[-1].strip()
    return "runs"


def measure(dims: dict, sizes: list[int], folder: Path) -> dict:
    rng = np.random.default_rng(1)
    kernels = {kind: Kernel(kind, dims, max(sizes) + 64, 2, folder) for kind in KINDS}
    steps: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in sizes} for kind in KINDS}
    for n in sizes:
        q, k, v = _inputs(dims, 1, 1, rng)
        for kernel in kernels.values():
            kernel.run(q, k, v, [n])  # warm
        for _ in range(RUNS):  # interleaved, so a slow moment costs every kind alike
            for kind, kernel in kernels.items():
                start = time.perf_counter()
                kernel.run(q, k, v, [n])
                steps[kind][n].append(time.perf_counter() - start)
    return {
        kind: {
            "decode_ms": {
                str(n): round(1000 * statistics.median(steps[kind][n]), 1) for n in sizes
            },
            "verify_gap": verify_gap(kernels[kind], rng),
            "batched_verify": batched_verify(kernels[kind], rng),
        }
        for kind in KINDS
    }


def markdown(result: dict) -> str:
    d, sizes = result["dims"], result["sizes"]
    lines = [
        "# Attention kernels over a long cache",
        "",
        f"Attention alone, {d['layers']} layers of {d['heads']} query heads over {d['kv']} kv "
        f"heads of {d['hd']} (the default target's shape), float32, the cache bound in place. "
        f"Decode: the median of {RUNS} one-token steps per context length, the kinds "
        "interleaved. Verify = decode: a call of 4 tokens against 4 calls of one, max "
        f"|difference| (0: bit for bit). `{result['command']}`",
        "",
        "| form | "
        + " | ".join(f"decode at {n:,}" for n in sizes)
        + " | verify = decode | 2 rows x 4 tokens after a past |",
        "|---" * (len(sizes) + 3) + "|",
    ]
    for kind, row in result["kinds"].items():
        cells = [f"{row['decode_ms'][str(n)]:.1f} ms" for n in sizes]
        gap = "bit for bit" if row["verify_gap"] == 0 else f"differs by {row['verify_gap']:.2g}"
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {gap} | {row['batched_verify']} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--sizes", default="1000,4000,8000", show_default=True, help="Context lengths.")
@click.option("--layers", default=28, show_default=True)
@click.option("--heads", default=12, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-attention-kernels"))
def main(sizes: str, layers: int, heads: int, kv_heads: int, head_dim: int, out: Path) -> None:
    import tempfile

    dims = {"layers": layers, "heads": heads, "kv": kv_heads, "hd": head_dim}
    lengths = [int(n) for n in sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        kinds = measure(dims, lengths, Path(folder))
    result = {
        "kind": "attention_kernels",
        "machine": machine.describe(),
        "command": f"python benchmarks/attention_kernels.py --sizes {sizes}",
        "dims": dims,
        "sizes": lengths,
        "kinds": kinds,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
