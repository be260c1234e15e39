"""Shared fixtures: tiny real models (built offline, fixed seeds) and bundles built from them.

Building is the slow part, so pairs and bundles are session-scoped and every test that changes
a bundle works on its own copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specrt.exporter.build import build_bundle
from specrt.exporter.tiny import make_tiny_pair

MAX_CONTEXT = 128


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="session")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Tiny (draft, target) HF folders per architecture, sharing one trained BPE tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_pair(root / arch, arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def bundles(pairs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    for arch, (draft, target) in pairs.items():
        out[arch] = build_bundle(
            str(draft), str(target), root / arch, max_context=MAX_CONTEXT, log=_quiet
        )
    return out


PRECISION_COMBINATIONS = {  # name: (architecture, draft precision, target precision)
    "d-int4_t-fp32": ("qwen2", "int4", "fp32"),  # tied head: untied for the quantizer
    "d-int8_t-int4": ("llama", "int8", "int4"),
    "d-fp16_t-int8": ("qwen2", "fp16", "int8"),
}


@pytest.fixture(scope="session")
def precision_bundles(pairs, tmp_path_factory) -> dict[str, Path]:
    """Bundles of the tiny pairs at other precisions, keyed by their precision label."""
    from specrt.exporter.precision import Precision

    root = tmp_path_factory.mktemp("precision")
    built = {}
    for name, (arch, draft, target) in PRECISION_COMBINATIONS.items():
        built[name] = build_bundle(
            str(pairs[arch][0]),
            str(pairs[arch][1]),
            root / name,
            max_context=MAX_CONTEXT,
            precision={"draft": Precision(draft), "target": Precision(target)},
            log=_quiet,
        )
    return built


@pytest.fixture(scope="session")
def half_cache_bundle(pairs, tmp_path_factory) -> Path:
    """The llama pair as d-int8_t-int4 is, but both keeping keys and values in float16."""
    from specrt.exporter.precision import Precision

    draft, target = pairs["llama"]
    return build_bundle(
        str(draft),
        str(target),
        tmp_path_factory.mktemp("half-cache") / "b",
        max_context=MAX_CONTEXT,
        precision={
            "draft": Precision("int8", cache="float16"),
            "target": Precision("int4", cache="float16"),
        },
        log=_quiet,
    )


@pytest.fixture(scope="session")
def agree_bundle(tmp_path_factory) -> Path:
    """A draft that always agrees and costs a fraction of the target: the target has 16 layers,
    of which the last 14 add nothing (zero output projections), and the draft is the first 2."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("agree")
    draft, target = make_tiny_pair(root, "llama", layers=(2, 16))
    model = AutoModelForCausalLM.from_pretrained(target)
    for layer in model.model.layers[2:]:
        layer.self_attn.o_proj.weight.data.zero_()
        layer.mlp.down_proj.weight.data.zero_()
    model.save_pretrained(target)
    return build_bundle(str(draft), str(target), root / "b", max_context=MAX_CONTEXT, log=_quiet)


@pytest.fixture(scope="session")
def disagree_bundle(pairs, tmp_path_factory) -> Path:
    """A draft whose vocabulary projection is the target's shifted by one token, so its
    greedy choice is never the target's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, target = pairs["llama"]
    root = tmp_path_factory.mktemp("disagree")
    model = AutoModelForCausalLM.from_pretrained(target)
    model.lm_head.weight.data = model.lm_head.weight.data.roll(-1, dims=0)
    model.save_pretrained(root / "draft")
    AutoTokenizer.from_pretrained(target).save_pretrained(root / "draft")
    return build_bundle(
        str(root / "draft"), str(target), root / "b", max_context=MAX_CONTEXT, log=_quiet
    )


@pytest.fixture(scope="session")
def odd_rows_bundle(bundles, tmp_path_factory) -> Path:
    """The llama bundle with a target whose calls of an odd number of rows differ, on every
    machine (see row_checks.py): what the row probe and the padding controls run on."""
    from row_checks import odd_row_variant

    return odd_row_variant(bundles["llama"], tmp_path_factory.mktemp("odd-rows") / "b")


@pytest.fixture
def bundle_copy(bundles, tmp_path) -> Path:
    """A private copy of the llama bundle, for tests that damage it."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundles["llama"], copy)
    return copy


@pytest.fixture
def small_scout(monkeypatch):
    """The scout's sizes scaled to the tiny models' 128-token context: prompts the draft would
    read more than 16 tokens of are first read as their last 8 (and where the draft fell more
    than 4 behind, it reads on from the sequence's last 4), until 2 drafts were kept, and the
    window is offered while the answer left is a quarter of what it must read."""
    from specrt.runtime import drafters

    monkeypatch.setattr(drafters, "SCOUT", 8)
    monkeypatch.setattr(drafters, "RESUME", 4)
    monkeypatch.setattr(drafters, "SCOUT_FROM", 16)
    monkeypatch.setattr(drafters, "SCOUT_KEPT", 2)
    monkeypatch.setattr(drafters, "WIDEN_LEFT", 0.25)
