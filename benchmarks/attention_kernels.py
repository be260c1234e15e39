"""Attention kernels ONNX Runtime offers for a decode step over a long cache, measured here.

A graph of attention only (no projections: query, key and value come in as inputs), one layer
per model layer, over a cache bound in place as the CPU engine binds it, in three forms:

- `specrt`: what the exporter writes (`exporter/attention.py`, the same code): the cache laid
  out [batch, positions, kv_heads, head_dim]; a lone row bound at exactly the call's length is
  read in place (each kv head's keys a strided matrix the fused MatMul reads), and so is each
  row of a batch, through the row views the engine binds.
- `specrt-copied`: the same graph with the batch's row views left unbound, as a bundle built
  before them runs: the batch sliced row by row in a Loop, each row's context copied out.
- `head-major`: what the exporter wrote before: new keys and values scattered into a
  [batch, kv_heads, capacity, head_dim] buffer, the buffer sliced to the call's length (a
  copy), each kv head's query heads folded into rows, QKᵀ, an additive mask, softmax, then V.
- `gqa`: ONNX Runtime's fused `com.microsoft.GroupQueryAttention`, its past and present one
  shared buffer (in place, per-row lengths), as ONNX Runtime GenAI's builder emits it.

For each: the median decode step of one row at each context length and of 4 rows (a batch),
whether a verify call of 4 tokens gives each position bit for bit what 4 one-token calls give
(speculation rests on it), and whether a row scores the same beside another in a call of
2 rows x 4 tokens after a past (a batched verify) as alone.

    python benchmarks/attention_kernels.py [--sizes 1000,4000,8000] [--layers 28 --heads 12
        --kv-heads 2 --head-dim 128] [--out benchmarks/results/cpu-attention-kernels]
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from specrt import machine
from specrt.bundle import row_view
from specrt.exporter.attention import attend, call_shapes
from specrt.exporter.graph_io import row_views
from specrt.files import write_result

KINDS = ("specrt", "specrt-copied", "head-major", "gqa")
RUNS = 12  # decode steps timed per kind and size
BATCH = 4  # the batched decode step's rows


class _Graph:
    """The little the exporter's attention asks of its graph builder."""

    def __init__(self):
        self.nodes, self.inits, self.batch = [], [], ""
        self.cache, self.family = TensorProto.FLOAT, SimpleNamespace(attention_softcap=lambda: None)

    def op(self, op_type, *inputs, out=None, **attrs):
        out = out or f"t{len(self.nodes)}_{len(self.inits)}"
        domain = "com.microsoft" if op_type == "GroupQueryAttention" else None
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out

    def const(self, value, dtype=np.int64):
        name = f"c{len(self.inits)}"
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    @contextmanager
    def branch(self):
        outer, self.nodes = self.nodes, []
        try:
            yield self.nodes
        finally:
            self.nodes = outer


def build(kind: str, layers: int, heads: int, kv: int, hd: int) -> onnx.ModelProto:
    """The attention-only graph of one kind (see the module's docstring)."""
    g, f32, i64 = _Graph(), TensorProto.FLOAT, TensorProto.INT64
    in_place = kind.startswith("specrt")
    cache = ["B", "C", kv, hd] if in_place else ["B", kv, "C", hd]
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
            helper.make_tensor_value_info("input_ids", i64, ["B", "S"]),
            helper.make_tensor_value_info("attention_mask", i64, ["B", "T"]),
            helper.make_tensor_value_info("position_ids", i64, ["B", "S"]),
            helper.make_tensor_value_info("mask", f32, ["B", 1, 1, "S", "T"]),
        ]
    shapes = call_shapes(g, kv, hd, 1e-6, heads // kv) if in_place else None
    outputs, x = [], "q"
    for i in range(layers):
        names = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        inputs += [helper.make_tensor_value_info(n, f32, cache) for n in names]
        present = [f"present.{i}.key", f"present.{i}.value"]
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
        x = _layer(g, kind, i, x, shapes, heads, kv, hd)
    outputs.insert(0, helper.make_tensor_value_info("out", f32, ["B", "S", heads * hd]))
    g.op("Identity", x, out="out")
    if in_place:
        views, defaults = row_views(layers, kv, hd, f32)
        inputs, g.inits = inputs + views, g.inits + defaults
    graph = helper.make_graph(g.nodes, kind, inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _layer(g: _Graph, kind, i, x, shapes, heads, kv, hd) -> str:
    """One layer of the `specrt` or `head-major` form; returns its output [B, S, heads * hd]."""
    rep = heads // kv
    k = g.op("Reshape", "k", g.const([0, 0, kv, hd]))  # [B, S, kv, hd]
    v = g.op("Reshape", "v", g.const([0, 0, kv, hd]))
    q = g.op("Reshape", x, g.const([0, 0, kv, rep, hd]))  # [B, S, kv, rep, hd]
    q = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 3, 1, 4]), g.const([0, kv, -1, hd]))
    q = g.op("Mul", q, g.const(hd**-0.5, np.float32))  # [B, kv, rep * S, hd]
    if kind.startswith("specrt"):
        ctx = attend(g, i, q, k, v, shapes, "mask")
    else:
        k, v = g.op("Transpose", k, perm=[0, 2, 1, 3]), g.op("Transpose", v, perm=[0, 2, 1, 3])
        at = g.op("Expand", g.op("Unsqueeze", "position_ids", g.const([1, 3])), g.op("Shape", k))
        keys = g.op("ScatterElements", f"past_key_values.{i}.key", at, k, axis=2,
                    out=f"present.{i}.key")  # fmt: skip
        values = g.op("ScatterElements", f"past_key_values.{i}.value", at, v, axis=2,
                      out=f"present.{i}.value")  # fmt: skip
        total = g.op("Slice", g.op("Shape", "attention_mask"), g.const([1]), g.const([2]))
        keys = g.op("Slice", keys, g.const([0]), total, g.const([2]))
        values = g.op("Slice", values, g.const([0]), total, g.const([2]))
        scores = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2]))
        grouped = g.op("Concat", g.const([0, kv, rep, -1]), total, axis=0)
        scores = g.op("Add", g.op("Reshape", scores, grouped), "mask")
        flat = g.op("Concat", g.const([0, kv, -1]), total, axis=0)
        ctx = g.op("MatMul", g.op("Reshape", g.op("Softmax", scores, axis=-1), flat), values)
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
        self.in_place = kind.startswith("specrt")
        options = ort.SessionOptions()
        options.add_session_config_entry("session.force_spinning_stop", "1")  # as the engine
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        kv, hd = dims["kv"], dims["hd"]
        shape = [rows, capacity, kv, hd] if self.in_place else [rows, kv, capacity, hd]
        rng = np.random.default_rng(0)  # filled: every page of the context really read
        self.caches = [
            rng.standard_normal(shape, np.float32) * 0.5 for _ in range(2 * dims["layers"])
        ]

    def run(self, q, k, v, lengths: list[int], first: int = 0) -> np.ndarray:
        """One call of len(lengths) rows from slot `first`, each after its own past."""
        rows, width = q.shape[:2]
        total = max(lengths) + width
        bind = self.session.io_binding()
        bind.bind_output("out")
        for name, value in (("q", q), ("k", k), ("v", v), *self._lengths(lengths, width)):
            bind.bind_cpu_input(name, value)
        kv, hd, positions = self.dims["kv"], self.dims["hd"], self.capacity
        if self.in_place and rows == 1:  # a lone row at its length, as the engine
            positions = total
        shape = [rows, positions, kv, hd] if self.in_place else [rows, kv, positions, hd]
        for j, buffer in enumerate(self.caches):
            name = f"past_key_values.{j // 2}.{('key', 'value')[j % 2]}"
            address = buffer.ctypes.data + first * buffer[0].nbytes
            for bind_at, bound in (
                (bind.bind_input, name),
                (bind.bind_output, name.replace("past_key_values", "present")),
            ):
                bind_at(bound, "cpu", 0, np.float32, shape, address)
            if self.kind == "specrt" and rows > 1:  # each row's view, at its own length
                for row, length in enumerate(lengths):
                    at = address + row * buffer[0].nbytes
                    bind.bind_input(
                        row_view(name, row), "cpu", 0, np.float32, [1, length + width, kv, hd], at
                    )
        self.session.run_with_iobinding(bind)
        return bind.get_outputs()[0].numpy().copy()

    def _lengths(self, lengths: list[int], width: int) -> list[tuple[str, np.ndarray]]:
        total = max(lengths) + width
        if self.kind == "gqa":
            seqlens = np.asarray([n + width - 1 for n in lengths], np.int32)
            return [("seqlens_k", seqlens), ("total", np.asarray(total, np.int32))]
        pos = np.asarray(lengths)[:, None] + np.arange(width)
        allowed = np.arange(total)[None, None, :] <= pos[:, :, None]
        mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
        return [
            ("input_ids", np.zeros(pos.shape, np.int64)),
            ("attention_mask", np.ones((len(lengths), total), np.int64)),
            ("position_ids", pos.astype(np.int64)),
            ("mask", mask[:, None, None]),
        ]


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


def beside_gap(kernel: Kernel, rng) -> str:
    """Row 1 of a call of 2 rows x 4 tokens after pasts of 300 and 200, against that row alone:
    'bit for bit', 'differs by ...', or the kernel's refusal."""
    q, k, v = _inputs(kernel.dims, 2, 4, rng)
    try:
        both = kernel.run(q, k, v, [300, 200])
    except Exception as err:  # ONNX Runtime's own error types
        return str(err).split("Status Message: ")[-1].strip()
    alone = kernel.run(q[1:], k[1:], v[1:], [200], first=1)
    gap = float(np.abs(both[1:] - alone).max())
    return "bit for bit" if gap == 0 else f"differs by {gap:.2g}"


def _timed(kernels: dict, rows: int, lengths: list[int], rng) -> dict[str, float]:
    """The median step of each kind over the same inputs, the kinds interleaved (a slow moment
    costs every kind alike); a kind that refuses the call is left out."""
    q, k, v = _inputs(next(iter(kernels.values())).dims, rows, 1, rng)
    steps: dict[str, list[float]] = {}
    for kind, kernel in kernels.items():
        try:
            kernel.run(q, k, v, lengths)  # warm
            steps[kind] = []
        except Exception:  # ONNX Runtime's own error types: this kind cannot run it
            continue
    for _ in range(RUNS):
        for kind in steps:
            start = time.perf_counter()
            kernels[kind].run(q, k, v, lengths)
            steps[kind].append(time.perf_counter() - start)
    return {kind: round(1000 * statistics.median(times), 1) for kind, times in steps.items()}


def measure(dims: dict, sizes: list[int], batch_context: int, folder: Path) -> dict:
    rng = np.random.default_rng(1)
    capacity = max(*sizes, batch_context) + 64
    kernels = {kind: Kernel(kind, dims, capacity, BATCH, folder) for kind in KINDS}
    decode = {n: _timed(kernels, 1, [n], rng) for n in sizes}
    batched = _timed(kernels, BATCH, [batch_context - 7 * r for r in range(BATCH)], rng)
    return {
        kind: {
            "decode_ms": {str(n): decode[n].get(kind) for n in sizes},
            "batch_ms": batched.get(kind),
            "verify_gap": verify_gap(kernels[kind], rng),
            "beside": beside_gap(kernels[kind], rng),
        }
        for kind in KINDS
    }


def markdown(result: dict) -> str:
    d, sizes = result["dims"], result["sizes"]
    batched = f"{BATCH} rows at {result['batch_context']:,}"
    lines = [
        "# Attention kernels over a long cache",
        "",
        f"Attention alone, {d['layers']} layers of {d['heads']} query heads over {d['kv']} kv "
        f"heads of {d['hd']} (the default target's shape), float32, the cache bound in place. "
        f"Decode: the median of {RUNS} one-token steps of one row per context length, and of "
        f"{BATCH} rows of about {result['batch_context']:,} positions each, the kinds "
        "interleaved. Verify "
        "= decode: a call of 4 tokens against 4 calls of one, max |difference| (0: bit for "
        "bit). Beside another row: a row of a call of 2 rows x 4 tokens against that row alone. "
        f"`{result['command']}`",
        "",
        "| form | "
        + " | ".join(f"decode at {n:,}" for n in sizes)
        + f" | {batched} | verify = decode | beside another row |",
        "|---" * (len(sizes) + 4) + "|",
    ]
    for kind, row in result["kinds"].items():
        cells = [_ms(row["decode_ms"][str(n)]) for n in sizes] + [_ms(row["batch_ms"])]
        gap = "bit for bit" if row["verify_gap"] == 0 else f"differs by {row['verify_gap']:.2g}"
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {gap} | {row['beside']} |")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "refused" if value is None else f"{value:.1f} ms"


@click.command()
@click.option("--sizes", default="1000,4000,8000", show_default=True, help="Context lengths.")
@click.option("--layers", default=28, show_default=True)
@click.option("--heads", default=12, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--batch-context", default=2000, show_default=True, help="Each batched row's.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-attention-kernels"))
def main(
    sizes: str, layers: int, heads: int, kv_heads: int, head_dim: int, batch_context: int, out: Path
) -> None:
    import tempfile

    dims = {"layers": layers, "heads": heads, "kv": kv_heads, "hd": head_dim}
    lengths = [int(n) for n in sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        kinds = measure(dims, lengths, batch_context, Path(folder))
    result = {
        "kind": "attention_kernels",
        "machine": machine.describe(),
        "command": f"python benchmarks/attention_kernels.py --sizes {sizes} "
        f"--batch-context {batch_context}",
        "dims": dims,
        "sizes": lengths,
        "batch_context": batch_context,
        "kinds": kinds,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
