"""The GPU graph's batched attention (exporter/batched_attention.py), run here on the CPU: ONNX
Runtime's CPU kernels take both forms, so what a GPU cannot show here (speed, Memcpy nodes) is
left to tests/test_gpu_engines.py, and everything else is checked against today's graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from batch_runs import alone_and_together

from specrt.bundle import Bundle
from specrt.engines.onnxruntime import OrtEngine
from specrt.errors import SpecrtError
from specrt.exporter.batched_attention import GpuGraph
from specrt.exporter.build import build_bundle
from specrt.exporter.graph import write_graph
from specrt.exporter.precision import Precision, convert_float16
from specrt.exporter.tensors import open_weights
from specrt.runtime import SpeculativeRuntime
from specrt.sources import Source

CAPACITY, MARGIN = 256, 64
ON_CPU = ["CPUExecutionProvider"]


def _calls(engine: OrtEngine) -> list[np.ndarray]:
    """A prefill, a decode, a verify of 5, then rows of 10 and 20 positions side by side (5
    and 2 new tokens) and three rows of unequal widths: the issue's probe shapes and more."""
    for slot in range(3):
        engine.reset(slot)
    out = [engine.forward_rows([(0, list(range(10, 30)))], last=3)[0]]
    out.append(engine.forward_rows([(1, list(range(40, 50)))], last=1)[0])
    out.append(engine.forward([5]))
    out += engine.forward_rows([(0, [7, 8, 9, 10, 11]), (1, [3, 4])])
    out += engine.forward_rows([(0, [1]), (1, [2]), (2, [3, 4, 5])])
    return out


@pytest.fixture(scope="module")
def graphs(pairs, tmp_path_factory) -> dict:
    """The tiny qwen2 target written with each attention, float32 and fp16."""
    root = tmp_path_factory.mktemp("attentions")
    tensors = open_weights(Source.parse(str(pairs["qwen2"][1])))
    out = {}
    for attention in ("in_place", "matmul", "onnx"):
        folder = root / attention
        folder.mkdir()
        write_graph(tensors, folder, CAPACITY + MARGIN, attention=attention)
        half = root / f"{attention}-fp16"
        half.mkdir()
        convert_float16(folder / "model.onnx", half)
        out[attention], out[f"{attention}-fp16"] = folder / "model.onnx", half / "model.onnx"
    return out


def _engine(graph, slots: int = 3) -> OrtEngine:
    shape = dict(num_layers=4, num_kv_heads=2, head_dim=16, vocab_size=384)
    return OrtEngine(graph, **shape, capacity=CAPACITY, margin=MARGIN, slots=slots)


@pytest.mark.parametrize("form", ["matmul", "onnx"])
def test_batched_attention_scores_as_todays_graph(graphs, form):
    """Within float32's rounding (attention over the whole buffer sums more, all of it exact
    zeros, in another order), and within fp16's where both graphs are fp16."""
    want = _calls(_engine(graphs["in_place"]))
    got = _calls(_engine(graphs[form]))
    assert max(float(np.abs(a - b).max()) for a, b in zip(want, got, strict=True)) < 1e-4
    want16 = _calls(_engine(graphs["in_place-fp16"]))
    got16 = _calls(_engine(graphs[f"{form}-fp16"]))
    assert max(float(np.abs(a - b).max()) for a, b in zip(want16, got16, strict=True)) < 5e-2
    assert all((a.argmax(-1) == b.argmax(-1)).all() for a, b in zip(want, got16, strict=True))


@pytest.mark.parametrize("form", ["matmul", "onnx"])
def test_the_gpu_graph_has_no_control_flow_and_caches_by_head(graphs, form):
    """What CUDA graphs and a Memcpy-free CUDA partition need: no If/Loop/Scan anywhere; the
    control is today's graph, which has them in every layer."""
    for name in (form, f"{form}-fp16"):
        model = onnx.load(str(graphs[name]), load_external_data=False)
        assert not {"If", "Loop", "Scan"} & {n.op_type for n in model.graph.node}
        dims = [d.dim_param or d.dim_value for d in model.graph.input[4].type.tensor_type.shape.dim]
        assert dims == ["batch_size", 2, "positions", 16]
    today = onnx.load(str(graphs["in_place"]), load_external_data=False)
    assert sum(n.op_type == "If" for n in today.graph.node) == 4


def test_the_engine_binds_a_graph_by_head_whole(graphs):
    engine = _engine(graphs["matmul"], slots=2)
    assert engine.by_head
    engine.forward_rows([(1, [5, 6, 7, 8])])
    assert engine._bound == (1, 1, CAPACITY + MARGIN)  # never at the call's length
    assert engine.read_positions(1, 0, 4) is None and not engine.copy_prefix(1, 0, 4)


@pytest.fixture(scope="module")
def gpu_bundle(pairs, tmp_path_factory):
    draft, target = pairs["llama"]
    out = tmp_path_factory.mktemp("gpu-bundle") / "b"
    fp32 = {role: Precision("fp32") for role in ("draft", "target")}
    build_bundle(
        str(draft),
        str(target),
        out,
        max_context=CAPACITY,
        precision=fp32,
        gpu=GpuGraph(precision="fp32"),
        log=lambda _: None,
    )
    return Bundle.load(out)


def test_a_gpu_build_records_each_roles_graph_and_checks_it(gpu_bundle):
    for role in ("draft", "target"):
        info = gpu_bundle.manifest["roles"][role]
        assert info["gpu"]["backends"] == ["onnxruntime-cuda"]
        assert gpu_bundle.role(role).graph_for("onnxruntime-cuda").is_file()
        assert gpu_bundle.role(role).graph_for("onnxruntime") == gpu_bundle.role(role).graph
        checked = info["export_check"]["gpu_graph_vs_float32"]
        assert checked["top1_agreement_vs_float32"] > 0.9
        assert "gpu/model.onnx" in info["files"]  # hashed like the rest
    from specrt.tools.inspection import bundle_lines

    shown = [line for line in bundle_lines(gpu_bundle) if line.startswith("gpu graph")]
    assert len(shown) == 2 and "fp32, matmul attention, for onnxruntime-cuda" in shown[1]
    with open(gpu_bundle.path / "manifest.json") as handle:
        assert json.load(handle)["roles"]["target"]["gpu"]["precision"] == "fp32"


def test_greedy_speculation_on_the_gpu_graph_equals_its_target_alone(gpu_bundle):
    """The GPU graphs (fp32: CPU kernels make fp16 logits depend on a call's width), run on
    the CPU through the runtime: speculation alone and in a batch of three gives the tokens of
    that target alone."""

    def engine(role, slots):
        return OrtEngine.from_bundle(
            gpu_bundle, role, "onnxruntime-cuda", providers=ON_CPU, slots=slots, even_rows=False
        )

    runtime = SpeculativeRuntime(
        gpu_bundle, engine("draft", 3), engine("target", 3), controller="fixed:3"
    )
    alone = SpeculativeRuntime(gpu_bundle, None, engine("target", 1), controller="fixed:0")
    prompts = ["def add(a, b):", "The quick brown", "import numpy as"]
    options = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [alone.generate(p, **options).token_ids for p in prompts]
    each, together, _ = alone_and_together(runtime, [(p, options) for p in prompts], slots=3)
    assert each == want and together == want


def test_a_gpu_graph_option_out_of_range_is_refused():
    assert GpuGraph() == GpuGraph("matmul", "fp16")  # the defaults: the goals are fp16
    with pytest.raises(SpecrtError, match="GPU attention"):
        GpuGraph("flash")
    with pytest.raises(SpecrtError, match="GPU precision"):
        GpuGraph(precision="bf16")


def test_placement_counts_copies_and_control_flow_in_every_subgraph(graphs):
    """The GPU tests' check, on what runs here: the CPU graph keeps control flow in each of its
    4 layers (the If between a lone row and a batch, the If between the row views and the
    Loop, the Loop, and the views' chain of VIEW_ROWS - 1 Ifs), the GPU graph none; and a
    Memcpy inside a Loop body is found (ONNX Runtime adds those only on a GPU, so the counter
    is checked on a graph made by hand)."""
    from onnx import TensorProto, helper

    from specrt.bundle import VIEW_ROWS
    from specrt.engines.ort_providers import count_nodes, placement

    per_layer = 3 + VIEW_ROWS - 1
    assert placement(graphs["in_place"], ON_CPU) == {"memcpy": 0, "control_flow": 4 * per_layer}
    assert placement(graphs["matmul"], ON_CPU) == {"memcpy": 0, "control_flow": 0}
    body = helper.make_graph(
        [helper.make_node("MemcpyToHost", ["x"], ["y"])],
        "body",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    loop = helper.make_node("Loop", ["n", ""], ["z"], body=body)
    outer = helper.make_graph([loop, helper.make_node("MemcpyFromHost", ["z"], ["w"])], "g", [], [])
    assert count_nodes(outer) == {"memcpy": 2, "control_flow": 1}


def test_captured_call_shapes_score_as_the_eager_calls(graphs):
    """CUDA graphs' bookkeeping, on the CPU's provider (where nothing is captured, but every
    call of a captured shape runs through its own fixed buffers, bound once): the same logits
    as the plain path; prompts past the widest shape and shapes past the limit run plainly."""
    import specrt.engines.cuda_graphs as cuda_graphs

    want = _calls(_engine(graphs["matmul"]))
    shape = dict(num_layers=4, num_kv_heads=2, head_dim=16, vocab_size=384)
    engine = OrtEngine(
        graphs["matmul"], **shape, capacity=CAPACITY, margin=MARGIN, slots=3, cuda_graphs=6
    )
    got = _calls(engine) + _calls(engine)  # the second time through, every shape is bound
    assert all(np.array_equal(a, b) for a, b in zip(want + want, got, strict=True))
    assert set(engine._graphs.shapes) == {(0, 1, 1, 1), (0, 2, 5, 5), (0, 3, 3, 3)}  # not 10 wide
    few = OrtEngine(graphs["matmul"], **shape, capacity=CAPACITY, margin=MARGIN, slots=3)
    few._graphs = cuda_graphs.CudaGraphs(few.session, "cpu", 6, limit=2)
    assert all(np.array_equal(a, b) for a, b in zip(want, _calls(few), strict=True))
    assert len(few._graphs.shapes) == 2
    with pytest.raises(SpecrtError, match="CUDA graphs need a graph without control flow"):
        OrtEngine(graphs["in_place"], **shape, capacity=CAPACITY, margin=MARGIN, cuda_graphs=6)


def test_cuda_graphs_go_with_the_gpu_graph_on_onnxruntime_cuda(gpu_bundle, bundles, monkeypatch):
    from specrt.engines.cuda_graphs import widest_for

    window = max(gpu_bundle.max_draft, gpu_bundle.max_lookup)
    assert widest_for(gpu_bundle.role("target"), "onnxruntime-cuda", window) == window + 1
    assert widest_for(gpu_bundle.role("target"), "onnxruntime", window) == 0
    assert widest_for(Bundle.load(bundles["llama"]).role("target"), "onnxruntime-cuda", 8) == 0
    monkeypatch.setenv("SPECRT_CUDA_GRAPHS", "0")
    assert widest_for(gpu_bundle.role("target"), "onnxruntime-cuda", window) == 0
