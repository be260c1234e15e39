"""Attention over the by-position cache (exporter/attention.py): a lone row bound at exactly its
call's length reads its cache in place, anything else goes row by row. Speculation at any batch
composition rests on the two scoring a row bit for bit alike, so the engine's row probe
compares a row beside another with the row alone at load, and its control must catch a graph
whose row-by-row path differs, on every machine."""

from __future__ import annotations

import warnings

import pytest
from row_checks import attention_paths_differ, mismatches, row_by_row_variant

from specrt.bundle import Bundle
from specrt.engines.onnxruntime import OrtEngine
from specrt.engines.rows import RowProbe


@pytest.fixture(scope="module")
def row_by_row_bundle(bundles, tmp_path_factory):
    return row_by_row_variant(bundles["llama"], tmp_path_factory.mktemp("row-by-row") / "b")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("role", ["draft", "target"])
def test_in_place_and_row_by_row_attention_agree_bit_for_bit(bundles, arch, role):
    assert attention_paths_differ(Bundle.load(bundles[arch]).role(role)) == 0.0


def test_a_lone_row_is_bound_at_its_length_and_a_batch_whole(bundles):
    """What the speed rests on: a lone row's call binds its slot at the call's total, so the
    graph takes the in-place path; a batch binds its slots whole (capacity plus margin)."""
    engine = OrtEngine.from_bundle(Bundle.load(bundles["llama"]), "target", slots=2)
    engine.forward_rows([(1, [5, 6, 7, 8])])
    assert engine._bound == (1, 1, 4)
    engine.forward_rows([(0, [5, 6]), (1, [9])])
    assert engine._bound == (0, 2, engine._positions_held)


def test_the_probe_finds_a_row_beside_another_scored_as_alone(bundles):
    engine = OrtEngine.from_bundle(Bundle.load(bundles["qwen2"]), "target", slots=2)
    assert engine.row_probe == RowProbe(0.0)
    assert engine.length == 0 and engine.held(1) == []  # the probe leaves both slots empty


def test_the_probe_catches_a_row_by_row_path_that_differs(row_by_row_bundle):
    """The control: the variant's rows score otherwise beside others, which padding cannot
    mend; the probe says so. With one slot no call goes row by row, and nothing differs."""
    bundle = Bundle.load(row_by_row_bundle)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        probe = OrtEngine.from_bundle(bundle, "target", slots=2).row_probe
    assert probe.unpadded > 0 and not probe.exact
    assert any("may differ from the target alone" in str(w.message) for w in said)
    assert OrtEngine.from_bundle(bundle, "target").row_probe == RowProbe(0.0)
    assert mismatches(bundle)  # and batched rows do differ from the rows alone
