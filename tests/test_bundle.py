"""Bundles load only when whole, untampered and consistent; builds are atomic."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specrt.bundle import MANIFEST, Bundle
from specrt.errors import BundleError, SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.tiny import make_tiny_pair
from specrt.runtime.api import SpeculativeRuntime


def _edit_manifest(bundle: Path, change) -> None:
    path = bundle / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_intact_bundle_loads(bundle_copy):
    bundle = Bundle.load(bundle_copy, full_check=True)
    assert bundle.max_draft == 8 and bundle.eos_token_ids


def test_missing_file_is_named(bundle_copy):
    (bundle_copy / "draft" / "model.onnx.data").unlink()
    with pytest.raises(BundleError, match=r"draft/model\.onnx\.data is missing"):
        Bundle.load(bundle_copy)


def test_corrupted_graph_is_refused_even_after_a_good_load(bundle_copy):
    Bundle.load(bundle_copy)  # leaves a verification stamp: the next load must still notice
    with open(bundle_copy / "target" / "model.onnx", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00garbage\x00")
    with pytest.raises(BundleError, match=r"target/model\.onnx does not match its recorded sha256"):
        Bundle.load(bundle_copy)


def test_tampered_hash_is_refused(bundle_copy):
    def tamper(m):
        m["roles"]["target"]["files"]["tokenizer.json"] = "0" * 64

    _edit_manifest(bundle_copy, tamper)
    with pytest.raises(BundleError, match=r"target/tokenizer\.json does not match"):
        Bundle.load(bundle_copy)


@pytest.mark.parametrize("version", [1, 99])
def test_unknown_format_version_is_refused(bundle_copy, version):
    """1: a bundle from before the by-position cache layout; 99: one from a later specrt."""
    _edit_manifest(bundle_copy, lambda m: m.update(format_version=version))
    with pytest.raises(BundleError, match=f"format version {version} is not supported.*rebuild"):
        Bundle.load(bundle_copy)


def test_logits_short_of_the_tokenizer_are_refused_on_load(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m["roles"]["draft"]["shape"].update(vocab_size=200))
    with pytest.raises(BundleError, match="vocabularies differ: draft has 200 logits"):
        Bundle.load(bundle_copy)


def test_a_pair_padded_differently_is_exact(pairs, tmp_path):
    """Logits padded past the shared tokenizer's ids, by 16 in the target and not in the draft
    (as Qwen2.5 7B's 152,064 against 0.5B's 151,936): the pair builds, and greedy speculation
    is the target alone's output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft, target = pairs["qwen2"]
    padded = tmp_path / "padded_target"
    model = AutoModelForCausalLM.from_pretrained(target)
    ids = model.config.vocab_size
    model.resize_token_embeddings(ids + 16, mean_resizing=False)
    with torch.no_grad():  # padding rows as real checkpoints hold them: never chosen
        model.get_output_embeddings().weight[ids:] = 0.0
        model.get_input_embeddings().weight[ids:] = 0.0
    model.save_pretrained(padded)
    AutoTokenizer.from_pretrained(target).save_pretrained(padded)
    out = build_bundle(str(draft), str(padded), tmp_path / "b", max_context=256, log=lambda _: 0)
    bundle = Bundle.load(out)
    assert bundle.role("target").dim("vocab_size") == bundle.role("draft").dim("vocab_size") + 16
    rt = SpeculativeRuntime.load(out, threads=1)
    for prompt in ("def fibonacci(n):", "The quick brown fox"):
        alone = rt.generate(prompt, max_new_tokens=24, speculate=False, ignore_eos=True)
        spec = rt.generate(prompt, max_new_tokens=24, controller="fixed:3", ignore_eos=True)
        assert spec.token_ids == alone.token_ids and spec.stats.accepted > 0


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="not a bundle"):
        Bundle.load(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle.load(tmp_path)


def test_build_refuses_mismatched_tokenizers(pairs, tmp_path):
    from transformers import AutoTokenizer

    draft, target = pairs["llama"]
    other = tmp_path / "other_draft"
    shutil.copytree(draft, other)
    tokenizer = AutoTokenizer.from_pretrained(draft)
    tokenizer.add_tokens(["<extra_token>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(SpecrtError, match="tokenizers differ"):
        build_bundle(str(other), str(target), tmp_path / "b", log=lambda _: None)
    assert not (tmp_path / "b").exists()


def test_failed_build_leaves_nothing_behind(pairs, tmp_path):
    from transformers import AutoConfig

    draft, target = pairs["llama"]
    broken = tmp_path / "gelu_target"
    shutil.copytree(target, broken)
    config = AutoConfig.from_pretrained(broken)
    config.hidden_act = "gelu"
    config.save_pretrained(broken)
    out = tmp_path / "out"
    with pytest.raises(SpecrtError, match="config.hidden_act 'gelu' is not supported"):
        build_bundle(str(draft), str(broken), out, max_context=128, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gelu_target"]


def test_existing_bundle_needs_force(pairs, bundles):
    draft, target = pairs["llama"]
    with pytest.raises(SpecrtError, match="already exists; pass --force"):
        build_bundle(str(draft), str(target), bundles["llama"], log=lambda _: None)


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(SpecrtError, match="no such folder or file"):
        build_bundle(str(tmp_path / "nope"), str(tmp_path / "nope2"), tmp_path / "b")


def test_runtime_and_onnxruntime_engine_import_no_torch():
    code = (
        "import sys, specrt.runtime, specrt.engines.onnxruntime, specrt.bundle;"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_tiny_pair_is_deterministic(tmp_path):
    a = make_tiny_pair(tmp_path / "a", "qwen2")[1] / "model.safetensors"
    b = make_tiny_pair(tmp_path / "b", "qwen2")[1] / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()
