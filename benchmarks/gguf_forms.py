"""What each MatMulNBits form of a weight costs on this CPU, outside any model.

A decoding step streams every weight once, so a form's cost is its bytes and the kernel's work
per block. This benchmark chains 24 projections shaped like a 1.5B model's MLP (1536 -> 8960 ->
1536, twelve times: 330 M weights, far past any cache) in one graph per form, and times one row
(decoding) and five rows (a verify call) with ONNX Runtime's CPU provider, 2 threads, the forms
interleaved round by round so that a slow spell of a shared machine falls on all of them.

The forms are the ones the exporter writes (see specrt/exporter/gguf_blocks.py) and the ones it
chose against: the int4 target's symmetric 4-bit blocks of 128; Q4_K's exact form (its scale per
32 values, its minimums through a float32 table over 32-input sums) and the block-32 scale alone;
a tried alternative with the minimums as 8-bit codes over 16-input sums (q uncentred, explicit
zero point 0: 5.75 bits, but no faster, and 2.6x the output error once the VNNI kernel quantizes
the activations and sums to int8); Q3_K's 4-bit and Q6_K's 8-bit blocks of 16, Q2_K's 4-bit
blocks of 16 with its minimums per 16; and for comparison 8-bit blocks of 128 and a float zero
point. The weights' values are random: speed does not depend on them.

    python benchmarks/gguf_forms.py [--rounds 3] [--out benchmarks/results/cpu-gguf-forms]
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specrt import machine
from specrt.files import write_result

HIDDEN, FFN, PAIRS = 1536, 8960, 12
# name: (bits, block, zero point ("default", "zero" or "float"), minimums ("table", "sums16"))
FORMS = {
    "int4, block 128 (the int4 target)": (4, 128, "default", None),
    "int4, block 32": (4, 32, "default", None),
    "Q4_K exact (as written): + float32 minimums table": (4, 32, "default", "table"),
    "Q4_K exact, tried: + 8-bit minimums over 16-sums": (4, 32, "zero", "sums16"),
    "Q3_K exact: int4, block 16": (4, 16, "default", None),
    "Q2_K exact: int4, block 16 + float32 minimums table per 16": (4, 16, "default", "table16"),
    "Q6_K exact: int8, block 16": (8, 16, "default", None),
    "Q8_0 / Q5_0 / IQ4_NL / IQ4_XS exact: int8, block 32": (8, 32, "default", None),
    "int8, block 128 (not exact for Q6_K)": (8, 128, "default", None),
    "int4, block 32, float zero point": (4, 32, "float", None),
}


def bits_per_weight(bits: int, block: int, zero: str, minimums: str | None) -> float:
    extra = {"default": 0.0, "zero": 4 / block, "float": 32 / block}[zero]
    extra += {None: 0.0, "table": 32 / 32, "table16": 32 / 16, "sums16": 8 / 16 + 32 / 256}[
        minimums
    ]
    return bits + 32 / block + extra


class Graph:
    """A chain of projections in one ONNX graph, each with its own random weights."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.nodes, self.inits, self.count = rng, [], [], 0

    def add(self, value: np.ndarray) -> str:
        self.count += 1
        name = f"w{self.count}"
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def nbits(self, x: str, k: int, n: int, bits: int, block: int, zero: str) -> str:
        blocks = k // block
        inputs = [
            x,
            self.add(self.rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)),
            self.add((self.rng.random(n * blocks, dtype=np.float32) * 0.02).astype(np.float32)),
        ]
        if zero == "zero":
            inputs.append(self.add(np.zeros(n * ((blocks + 1) // 2), np.uint8)))
        elif zero == "float":
            inputs.append(self.add(np.full(n * blocks, 7.5, np.float32)))
        return self.op(
            "MatMulNBits",
            *inputs,
            domain="com.microsoft",
            K=k,
            N=n,
            bits=bits,
            block_size=block,
            accuracy_level=4,
        )

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def sums(self, x: str, k: int, group: int) -> str:
        shape = self.add(np.array([-1, k // group, group], np.int64))
        grouped = self.op("Reshape", x, shape)
        return self.op("ReduceSum", grouped, self.add(np.array([-1], np.int64)), keepdims=0)

    def projection(self, x: str, k: int, n: int, form: tuple) -> str:
        bits, block, zero, minimums = form
        y = self.nbits(x, k, n, bits, block, zero)
        if minimums in ("table", "table16"):
            span = 16 if minimums == "table16" else 32
            table = self.add(self.rng.random((k // span, n), dtype=np.float32) * 1e-3)
            return self.op("Sub", y, self.op("MatMul", self.sums(x, k, span), table))
        if minimums == "sums16":
            shift = self.nbits(self.sums(x, k, 16), k // 16, n, 8, 16, "default")
            return self.op("Sub", y, shift)
        return y

    def session(self, x: str, out: str, threads: int) -> ort.InferenceSession:
        graph = helper.make_graph(
            self.nodes,
            "chain",
            [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", HIDDEN])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["M", HIDDEN])],
            self.inits,
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        model = helper.make_model(graph, opset_imports=opsets).SerializeToString()
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def chain(form: tuple, threads: int, seed: int = 0) -> ort.InferenceSession:
    graph, x = Graph(np.random.default_rng(seed)), "x"
    for _ in range(PAIRS):
        x = graph.projection(x, HIDDEN, FFN, form)
        x = graph.projection(x, FFN, HIDDEN, form)
    return graph.session("x", x, threads)


def median_ms(session: ort.InferenceSession, rows: int, runs: int) -> float:
    x = np.random.default_rng(1).standard_normal((rows, HIDDEN), dtype=np.float32)
    for _ in range(3):
        session.run(None, {"x": x})
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def markdown(result: dict) -> str:
    m, weights = result["machine"], result["weights"]
    lines = [
        "# MatMulNBits forms: bytes and time per weight",
        "",
        f"{machine.label(m)}; {m['date']}; {weights / 1e6:.0f} M weights in a chain of 24 "
        f"projections, the best of {result['rounds']} rounds of medians. `{result['command']}`",
        "",
        "| form | bits/weight | 1 row ms | ps/weight | vs int4 block 128 | 5 rows ms |",
        "|---|---|---|---|---|---|",
    ]
    base = next(iter(result["forms"].values()))["one_row_ms"]
    for name, f in result["forms"].items():
        lines.append(
            f"| {name} | {f['bits_per_weight']:.3f} | {f['one_row_ms']:.2f} | "
            f"{1e9 * f['one_row_ms'] / weights:.1f} | {f['one_row_ms'] / base:.2f}× | "
            f"{f['five_rows_ms']:.2f} |"
        )
    return "\n".join([*lines, ""])


@click.command()
@click.option("--rounds", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(rounds: int, threads: int, out: Path | None) -> None:
    sessions = {name: chain(form, threads) for name, form in FORMS.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"1": [], "5": []} for name in FORMS}
    for r in range(rounds):
        for name, session in sessions.items():
            for rows in ("1", "5"):
                runs = 3 if "float zero" in name else 15
                times[name][rows].append(median_ms(session, int(rows), runs))
            print(f"round {r + 1}: {name}: {times[name]['1'][-1]:.2f} ms", flush=True)
    result = {
        "kind": "gguf_forms",
        "command": f"python benchmarks/gguf_forms.py --rounds {rounds} --threads {threads}",
        "machine": machine.describe(threads),
        "rounds": rounds,
        "weights": 2 * PAIRS * HIDDEN * FFN,
        "forms": {
            name: {
                "bits_per_weight": bits_per_weight(*FORMS[name]),
                "one_row_ms": min(times[name]["1"]),
                "five_rows_ms": min(times[name]["5"]),
            }
            for name in FORMS
        },
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
