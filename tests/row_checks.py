"""Row-invariance checks shared by the batching, precision and gguf tests, and the target whose
odd calls differ on every machine, which their controls run on.

A control must fail on every CPU. Whether ONNX Runtime's MatMulNBits gives an odd call's last
row to a kernel of its own depends on the CPU (it does on AVX2, not for every form on
AVX-512/VNNI), so the controls do not hope for it: `odd_row_variant` copies a float32 bundle
and adds to the target graph's logits a fixed random vector whenever the call carries an odd
number of rows (batch x new tokens), which is what that kernel does, in the real graph run by
the real engine, on any machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.bundle import MANIFEST, Bundle, Role
from specrt.engines.onnxruntime import OrtEngine
from specrt.exporter.check import _steps
from specrt.exporter.graph import ModelShape
from specrt.files import sha256_file
from specrt.machine import describe, label

PREFIXES = [list(range(10, 17 + 3 * slot)) for slot in range(5)]  # 7, 10, 13, 16, 19 tokens
NEW = [list(range(60 + 5 * slot, 60 + 5 * slot + n)) for slot, n in enumerate([1, 3, 5, 2, 4])]
BATCHES = ([0, 1], [0, 1, 2], [1, 2, 3, 4], [0, 2, 4], [0, 1, 2, 3, 4], [3], [4, 1])
CHUNKINGS = ([1] * 12, [3] * 4, [5, 7], [2, 3, 7], [9, 3])


def this_machine() -> str:
    """The CPU and its SIMD features, for assertion messages about kernel behaviour."""
    return label(describe())


def _alone(bundle: Bundle, slot: int, **options) -> np.ndarray:
    engine = OrtEngine.from_bundle(bundle, "target", threads=2, **options)
    engine.forward(PREFIXES[slot], last=1)
    return engine.forward(NEW[slot])


def mismatches(bundle: Bundle, wrong_prefix: int | None = None, **options) -> list:
    """(batch, slot) for every row whose batched logits differ from the row alone. With
    wrong_prefix, that slot's context in the batched engine ends in another token than the
    one it had alone: a row that must be reported in every batch it is in."""
    alone = [_alone(bundle, slot, **options) for slot in range(5)]
    engine = OrtEngine.from_bundle(bundle, "target", threads=2, slots=5, **options)
    found = []
    for batch in BATCHES:
        for slot, prefix in enumerate(PREFIXES):
            engine.reset(slot)
            if slot == wrong_prefix:
                prefix = [*prefix[:-1], prefix[-1] + 1]
            engine.forward_rows([(slot, prefix)], last=1)
        rows = engine.forward_rows([(slot, NEW[slot]) for slot in batch])
        found += [
            (batch, s)
            for s, row in zip(batch, rows, strict=True)
            if not np.array_equal(row, alone[s])
        ]
    return found


def chunked(engine: OrtEngine, chunks: list[int]) -> np.ndarray:
    """Logits of 12 new tokens after a 21-token (odd) prompt, fed in calls of `chunks` tokens."""
    engine.reset()
    engine.forward(list(range(10, 31)), last=1)
    rows, fed = [], 0
    for count in chunks:
        rows.append(engine.forward(list(range(40 + fed, 40 + fed + count))))
        fed += count
    return np.concatenate(rows)


def cuts_differ(engine: OrtEngine) -> list[list[int]]:
    """The chunkings whose logits differ from feeding all 12 tokens in one call."""
    whole = chunked(engine, [12])
    return [chunks for chunks in CHUNKINGS if not np.array_equal(chunked(engine, chunks), whole)]


def odd_row_variant(source: Path, out: Path, scale: float = 3.0) -> Path:
    """A copy of a float32 bundle whose target adds a fixed N(0, scale) vector to the logits of
    every call with an odd number of rows (large enough to change greedy choices)."""
    shutil.copytree(source, out)
    role = Bundle.load(out).role("target")
    model = onnx.load(str(role.graph), load_external_data=False)
    graph = model.graph
    producer = next(node for node in graph.node if "logits" in node.output)
    producer.output[list(producer.output).index("logits")] = "logits_exact"
    vocab = role.dim("vocab_size")
    noise = np.random.default_rng(0).normal(0, scale, vocab).astype(np.float32)
    graph.initializer.extend(
        [
            numpy_helper.from_array(noise, "odd_rows_noise"),
            numpy_helper.from_array(np.array([0], np.int64), "odd_rows_i0"),
            numpy_helper.from_array(np.array([1], np.int64), "odd_rows_i1"),
            numpy_helper.from_array(np.array(2, np.int64), "odd_rows_two"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], ["odd_rows_shape"]),
            helper.make_node("Gather", ["odd_rows_shape", "odd_rows_i0"], ["odd_rows_b"]),
            helper.make_node("Gather", ["odd_rows_shape", "odd_rows_i1"], ["odd_rows_s"]),
            helper.make_node("Mul", ["odd_rows_b", "odd_rows_s"], ["odd_rows_n"]),
            helper.make_node("Mod", ["odd_rows_n", "odd_rows_two"], ["odd_rows_odd"]),
            helper.make_node("Cast", ["odd_rows_odd"], ["odd_rows_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["odd_rows_f", "odd_rows_noise"], ["odd_rows_add"]),
            helper.make_node("Add", ["logits_exact", "odd_rows_add"], ["logits"]),
        ]
    )
    return _save_target(out, role, model)


def row_by_row_variant(source: Path, out: Path) -> Path:
    """A copy of a float32 bundle whose target scales each row's attention by 1 + 2^-10 in the
    batch's paths only (its rows read through their views, or copied row by row), never where a
    lone row reads its cache in place: a row then scores otherwise beside others than alone."""
    shutil.copytree(source, out)
    role = Bundle.load(out).role("target")
    model = onnx.load(str(role.graph), load_external_data=False)
    for node in (n for n in model.graph.node if n.op_type == "If"):
        rows = next(a.g for a in node.attribute if a.name == "else_branch")  # views or Loop
        row = rows.output[0].name
        rows.initializer.append(numpy_helper.from_array(np.float32(1 + 2**-10), f"{row}_by"))
        rows.node.append(helper.make_node("Mul", [row, f"{row}_by"], [f"{row}_scaled"]))
        rows.output[0].name = f"{row}_scaled"
    return _save_target(out, role, model)


def _save_target(out: Path, role, model: onnx.ModelProto) -> Path:
    """Write the edited target graph back, and its new hash into the manifest."""
    onnx.save(model, str(role.graph))
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["roles"]["target"]["files"][role.info["graph"]] = sha256_file(role.graph)
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return out


def attention_paths_differ(role: Role, steps=(("prompt", 7), ("new", 3))) -> float:
    """The largest |difference| between the logits of one row (a prompt, then new tokens on
    top) whose caches are bound at exactly each call's length, which the graph reads in place,
    and bound wider, which it reads row by row (exporter/attention.py); 0.0: bit for bit."""
    shape = ModelShape(**role.info["shape"])
    ids = np.arange(11, 11 + sum(n for _, n in steps), dtype=np.int64)[None]
    in_place, by_row = (
        np.concatenate([logits for *_, logits in _steps(role.graph, shape, ids, steps, wider)], 1)
        for wider in (0, 5)
    )
    return float(np.max(np.abs(in_place - by_row)))
