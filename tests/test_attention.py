"""Attention over the by-position cache (exporter/attention.py): a lone row bound at exactly its
call's length reads its cache in place, a batch's rows read theirs in place through their row
views, and anything else goes row by row, copied. Speculation at any batch composition rests on
these scoring a row bit for bit alike, so the engine's row probe compares a row beside another
with the row alone at load, and its control must catch a graph whose batch paths differ, on
every machine."""

from __future__ import annotations

import warnings

import numpy as np
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


def _batch_after_prefixes(engine: OrtEngine) -> list:
    """Three rows of 2, 3 and 1 new tokens after prefixes of 9, 5 and 12 tokens."""
    for slot, length in enumerate((9, 5, 12)):
        engine.reset(slot)
        engine.forward_rows([(slot, list(range(20 + slot, 20 + slot + length)))], last=1)
    return engine.forward_rows([(0, [40, 41]), (1, [50, 51, 52]), (2, [60])])


def test_a_batch_reads_its_rows_through_their_views_as_the_loop_would(bundles):
    """A batch's rows read their caches where they lie (row views) and score bit for bit what
    the row-by-row Loop, which copies each row out, scores. The control: views that end
    before the call's positions (each row's new keys left out) score otherwise, so the views
    are what is read."""
    engine = OrtEngine.from_bundle(Bundle.load(bundles["qwen2"]), "target", slots=3)
    assert engine._view_rows > 0
    viewed = _batch_after_prefixes(engine)
    engine.read_rows_in_place(False)  # as a graph without views: the Loop
    copied = _batch_after_prefixes(engine)
    assert all(np.array_equal(a, b) for a, b in zip(viewed, copied, strict=True))
    engine.read_rows_in_place(True)
    bind = engine._bind_views
    engine._bind_views = lambda binding, first, lengths: bind(binding, first, lengths - 3)
    short = _batch_after_prefixes(engine)
    assert not any(np.array_equal(a, b) for a, b in zip(short, copied, strict=True))


def test_each_constant_value_is_one_initializer(bundles):
    """A subgraph takes every outer constant it reads as an implicit input, handed over on each
    execution (graph.py `const`), so the builder writes each value once."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(Bundle.load(bundles["qwen2"]).role("target").graph)).graph
    values = [
        numpy_helper.to_array(init) for init in graph.initializer if init.name.startswith("const_")
    ]
    keys = [(v.dtype.str, v.shape, v.tobytes()) for v in values]
    assert len(values) > 10 and len(set(keys)) == len(keys)
