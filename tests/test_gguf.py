"""The gguf precision: a GGUF file's own blocks, run exactly.

Unpacking is checked against gguf-py's reference dequantization on every supported type; whole
bundles from tiny GGUF files (Qwen2, and Llama, whose q/k rows transformers reorders) must
reproduce the float32 graph's logits when activations stay float32, keep greedy speculation
exact, keep rows batch-invariant, and say which weights had no exact form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.utils
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_files import random_blocks, write_tiny_gguf
from onnx import numpy_helper
from row_checks import mismatches, this_machine

from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.engines.onnxruntime import OrtEngine
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.gguf_blocks import SUPPORTED, row_permutation, to_blocks
from specrt.exporter.graph import write_graph
from specrt.exporter.precision import Precision
from specrt.exporter.projections import EMBEDDED, projections_for
from specrt.exporter.tensors import GgufFile, open_weights, unfused
from specrt.exporter.tiny import TINY_SHAPE
from specrt.runtime import SpeculativeRuntime
from specrt.sources import Source
from specrt.tools.quality import Comparison, text_labels

MAX_CONTEXT = 128


def _quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("kind", SUPPORTED)
def test_blocks_reproduce_the_reference_dequantization(kind):
    raw = random_blocks(kind, 6, 512, np.random.default_rng(1))
    want = dequantize(raw, getattr(GGMLQuantizationType, kind))
    blocks = to_blocks(kind, raw, 512)
    assert np.array_equal(blocks.dequantize(), want)
    assert blocks.values.dtype == np.uint8 and blocks.packed().shape[:2] == (
        6,
        512 // blocks.block_size,
    )


def test_a_changed_bit_is_seen():
    """The control: one flipped value bit changes the dequantized weight."""
    raw = random_blocks("Q4_K", 2, 256, np.random.default_rng(2))
    flipped = raw.copy()
    flipped[0, 100] ^= 1
    assert not np.array_equal(
        to_blocks("Q4_K", raw, 256).dequantize(), to_blocks("Q4_K", flipped, 256).dequantize()
    )


def test_llama_row_order_matches_transformers():
    """transformers' reverse permutation of q/k, applied to row indices."""
    heads, dim = 4, 6
    w = np.arange(heads * dim * 2)[:, None] * np.ones((1, 3))
    reordered = w.reshape(heads, dim, 2, 3).swapaxes(2, 1).reshape(w.shape)
    assert np.array_equal(w[row_permutation(len(w), heads)], reordered)


@pytest.mark.parametrize("kind", SUPPORTED)
def test_a_gguf_embedding_stays_in_its_blocks_and_gathers_the_same_rows(kind, tmp_path):
    """A quantized role keeps a GGUF's embedding table in the file's blocks, a sixth to a
    third of its float32 bytes, and the rows it gathers are the float32 table's, bit for bit;
    the float32 path gives the same rows from the full table (the comparison's reference)."""
    path = write_tiny_gguf(tmp_path / "m.gguf", types={"token_embd": kind})
    tensors = open_weights(Source.parse(str(path)))
    vocab, hidden = tensors.shape("model.embed_tokens.weight")
    ids = np.array([[0, 1, vocab - 1], [vocab // 2, 7, 7]], np.int64)
    want = tensors.rows("model.embed_tokens.weight", ids.ravel()).reshape(*ids.shape, hidden)
    for weights in ("gguf", "int4", "fp32"):
        out = tmp_path / weights
        out.mkdir()
        write_graph(tensors, out, MAX_CONTEXT, projections_for(Precision(weights)))
        onnx.utils.extract_model(
            str(out / "model.onnx"), str(out / "embed.onnx"), ["input_ids"], [EMBEDDED]
        )
        session = ort.InferenceSession(str(out / "embed.onnx"))
        assert np.array_equal(session.run(None, {"input_ids": ids})[0], want), weights
        graph = onnx.load(str(out / "embed.onnx"))
        table = sum(numpy_helper.to_array(i).nbytes for i in graph.graph.initializer)
        if weights == "fp32":
            assert table >= 4 * vocab * hidden
        else:
            assert table <= 4 * vocab * hidden / 2.9, f"{weights}: {table} bytes"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    return {
        "qwen2": write_tiny_gguf(root / "tiny-qwen2.gguf", "qwen2"),
        "llama": write_tiny_gguf(root / "tiny-llama.gguf", "llama", seed=1),
        "mixed": write_tiny_gguf(
            root / "tiny-mixed.gguf",
            "qwen2",
            seed=2,
            types={"ffn_down": "IQ2_XXS", "attn_output": "F16"},
        ),
    }


def _build(path, out, precision: Precision, draft: bool = True, log=_quiet):
    spec = str(path)
    roles = {"target": precision, "draft": precision} if draft else {"target": precision}
    return build_bundle(
        spec if draft else None, spec, out, max_context=MAX_CONTEXT, precision=roles, log=log
    )


@pytest.fixture(scope="module")
def gguf_bundles(gguf_files, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf-bundles")
    return {
        arch: _build(gguf_files[arch], root / arch, Precision("gguf"))
        for arch in ("qwen2", "llama")
    }


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_float_activations_give_the_float32_graph(gguf_files, tmp_path, arch):
    """With activations in float32 (accuracy level 1) the only difference left is the weights:
    none, up to float rounding of the scales."""
    out = _build(gguf_files[arch], tmp_path / "b", Precision("gguf", accuracy_level=1), draft=False)
    check = Bundle.load(out).role("target").info["export_check"]
    assert check["max_abs_logit_diff_vs_float32"] < 1e-4
    assert check["top1_agreement_vs_float32"] == 1.0


def test_the_low_bit_types_are_exact_in_a_whole_model(tmp_path):
    """Q2_K, Q3_K and the IQ4 codes (what Q2_K, Q3_K_M and IQ4_XS files hold) in a model: with
    float32 activations its logits are the float32 graph's, and the manifest names their forms."""
    types = {
        "attn_q": "Q3_K",
        "attn_k": "Q2_K",
        "ffn_gate": "IQ4_XS",
        "ffn_up": "IQ4_NL",
        "token_embd": "IQ4_XS",
    }
    path = write_tiny_gguf(tmp_path / "low.gguf", seed=3, types=types)
    out = _build(path, tmp_path / "b", Precision("gguf", accuracy_level=1), draft=False)
    role = Bundle.load(out).role("target")
    check, precision = role.info["export_check"], role.info["precision"]
    assert check["max_abs_logit_diff_vs_float32"] < 1e-4
    forms = precision["tensors"]
    assert forms["layers.0.self_attn.q_proj.weight_t"] == "Q3_K as 4 bits, block 16"
    assert (
        forms["layers.0.self_attn.k_proj.weight_t"]
        == "Q2_K as 4 bits, block 16 + offsets per 16 inputs"
    )
    assert forms["layers.1.mlp.gate_proj.weight_t"] == "IQ4_XS as 8 bits, block 32"
    assert forms["layers.1.mlp.up_proj.weight_t"] == "IQ4_NL as 8 bits, block 32"
    assert precision["embedding"] == "IQ4_XS as 8 bits, block 32, gathered"


def test_manifest_and_graph_record_each_weights_form(gguf_bundles):
    role = Bundle.load(gguf_bundles["qwen2"]).role("target")
    precision = role.info["precision"]
    assert precision["weights"] == "gguf"
    forms = precision["tensors"]
    assert (
        forms["layers.0.self_attn.q_proj.weight_t"]
        == "Q4_K as 4 bits, block 32 + offsets per 32 inputs"
    )
    assert forms["lm_head.weight_t"] == "Q6_K as 8 bits, block 16"
    assert len(forms) == 2 * 7 + 1
    assert precision["embedding"] == "Q5_1 as 8 bits, block 32 + offsets per 32 inputs, gathered"
    graph = onnx.load(str(role.graph), load_external_data=False)
    matmuls = [n for n in graph.graph.node if n.op_type == "MatMul"]
    assert all(not n.input[1].endswith(".weight_t") for n in matmuls)  # no float projections
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == len(forms)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_speculation_equals_the_gguf_target_alone(gguf_bundles, arch):
    rt = SpeculativeRuntime.load(gguf_bundles[arch], threads=1)
    for prompt in ("def fibonacci(n):", "The quick brown fox"):
        alone = rt.generate(prompt, max_new_tokens=30, speculate=False, ignore_eos=True)
        for controller in ("fixed:1", "fixed:4"):
            spec = rt.generate(prompt, max_new_tokens=30, controller=controller, ignore_eos=True)
            assert spec.token_ids == alone.token_ids
            assert spec.stats.accepted > 0  # the draft is the same model: it is accepted


def test_gguf_rows_are_batch_invariant(gguf_bundles):
    """Rows match themselves alone with the padding the engine probed for; whether the GGUF's
    4-bit forms need it depends on the CPU (on AVX2 they do), so the probe's verdict must be
    what the unpadded rows show. The comparison's own controls are in test_batching."""
    bundle = Bundle.load(gguf_bundles["llama"])
    assert mismatches(bundle) == []
    probe = OrtEngine.from_bundle(bundle, "target").row_probe
    unpadded = mismatches(bundle, even_rows=False)
    found = f"on {this_machine()}: the probe found {probe.describe()}; rows that differ: {unpadded}"
    assert probe.exact, found
    if not probe.pads:
        assert unpadded == [], found


def test_types_without_an_exact_form_say_so(gguf_files, tmp_path):
    lines = []
    out = _build(
        gguf_files["mixed"], tmp_path / "b", Precision("gguf"), draft=False, log=lines.append
    )
    forms = Bundle.load(out).role("target").info["precision"]["tensors"]
    assert (
        forms["layers.0.mlp.down_proj.weight_t"] == "IQ2_XXS re-quantized to int4 (no exact form)"
    )
    assert forms["layers.0.self_attn.o_proj.weight_t"] == "F16 kept as float32"
    assert any("no exact form" in line for line in lines)


def test_gguf_needs_a_gguf_source(pairs, tmp_path):
    draft, target = pairs["qwen2"]
    with pytest.raises(SpecrtError, match="not a GGUF file"):
        build_bundle(
            None, str(target), tmp_path / "b", precision={"target": Precision("gguf")}, log=_quiet
        )
    assert not (tmp_path / "b").exists()


def test_comparison_figures_and_their_control():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (20, 50)).astype(np.float32)
    targets = rng.integers(0, 50, 20)
    same = Comparison.of(logits, logits, targets).summary()
    assert same.kl_mean == pytest.approx(0, abs=1e-9) and same.top1_agreement == 1
    assert same.perplexity == pytest.approx(same.reference_perplexity)
    other = Comparison.of(logits + rng.normal(0, 1, logits.shape), logits, targets).summary()
    assert other.kl_mean > 0.01 and other.top1_agreement < 1


def test_eval_compares_each_role_on_real_text(gguf_bundles, gguf_files, tmp_path):
    reference = _build(gguf_files["qwen2"], tmp_path / "fp32", Precision("fp32"))
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            str(gguf_bundles["qwen2"]),
            "--reference",
            str(reference),
            "--tokens",
            "100",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "KL mean" in result.output and "decoder.py" in result.output
    roles = json.loads(out.read_text())["roles"]
    assert set(roles) == {"draft", "target"}
    for texts in roles.values():
        assert set(texts) == {"decoder.py", "prose.txt"}
        for s in texts.values():
            assert s["tokens"] == 99 and s["kl_mean"] >= 0 and 0 < s["top1_agreement"] <= 1


def test_texts_sharing_a_file_name_are_reported_apart():
    texts = [Path("a/notes.txt"), Path("b/notes.txt"), Path("c/decoder.py")]
    assert text_labels(texts) == ["a/notes.txt", "b/notes.txt", "decoder.py"]


def test_inspect_names_the_blocks_and_the_prose_check(gguf_bundles):
    result = CliRunner().invoke(cli, ["inspect", str(gguf_bundles["qwen2"])])
    assert result.exit_code == 0, result.output
    assert "target gguf (the GGUF's own blocks: " in result.output
    assert "Q4_K" in result.output and "tokens of prose: KL" in result.output


def test_eval_refuses_a_text_too_short(gguf_bundles, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x")
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            str(gguf_bundles["qwen2"]),
            "--reference",
            str(gguf_bundles["qwen2"]),
            "--text",
            str(short),
        ],
    )
    assert result.exit_code == 1 and "at least two tokens" in result.output


def test_a_phi3_gguf_reads_its_fused_projections_as_their_parts(tmp_path):
    """llama.cpp's converter keeps Phi-3's q/k/v as attn_qkv and gate/up as one ffn_up of both
    halves (no ffn_gate): the reader names them as transformers' fused tensors, and each part
    the graph writer reads is its band of rows."""
    import gguf
    from transformers import Phi3Config

    config = Phi3Config(**TINY_SHAPE, num_hidden_layers=1, vocab_size=32, pad_token_id=0)
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads  # k's rows, v's too
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (32, hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_qkv.weight": (hidden + 2 * kv, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_up.weight": (2 * inner, hidden),
        "blk.0.ffn_down.weight": (hidden, inner),
        "output_norm.weight": (hidden,),
        "output.weight": (32, hidden),
    }
    values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    for name, value in values.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = unfused(GgufFile(tmp_path / "phi3.gguf", config))
    layer = "model.layers.0"
    assert "self_attn.qkv_proj" not in " ".join(tensors.names())
    qkv, up = values["blk.0.attn_qkv.weight"], values["blk.0.ffn_up.weight"]
    bands = {
        "self_attn.q_proj": qkv[:hidden],
        "self_attn.k_proj": qkv[hidden : hidden + kv],
        "self_attn.v_proj": qkv[hidden + kv :],
        "mlp.gate_proj": up[:inner],
        "mlp.up_proj": up[inner:],
    }
    for part, want in bands.items():
        name = f"{layer}.{part}.weight"
        assert tensors.shape(name) == want.shape
        assert np.array_equal(tensors.rows(name, np.arange(len(want))), want), part


def test_a_gguf_pair_builds_as_a_user_expects_with_no_flags(gguf_files, tmp_path):
    """`specrt build --draft D.gguf --target T.gguf --out B` and nothing else: the target as
    the file's own blocks, an int4 draft, the model's own context (the file says 1,024)."""
    spec, out = str(gguf_files["qwen2"]), tmp_path / "b"
    done = CliRunner().invoke(cli, ["build", "--draft", spec, "--target", spec, "--out", str(out)])
    assert done.exit_code == 0, done.output
    bundle = Bundle.load(out)
    assert (bundle.role("draft").precision, bundle.role("target").precision) == ("int4", "gguf")
    assert bundle.max_context == 1024
