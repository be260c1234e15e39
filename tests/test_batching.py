"""Batch invariance: a row's logits do not depend on what else is in the call.

The same rows are scored alone (an engine holding one sequence) and inside batches of other
sizes, with ragged prefixes and ragged new tokens, and must give bit-identical logits; the
controls show the comparison fails when a row's context is wrong, and when a target's numbers
do depend on the batch (a target built to differ on odd calls, on every machine)."""

from __future__ import annotations

import pytest
from batch_runs import alone_and_together
from row_checks import BATCHES, mismatches

from specrt.bundle import Bundle
from specrt.engines.onnxruntime import OrtEngine
from specrt.errors import SpecrtError


@pytest.mark.parametrize("name", ["llama", "qwen2", "d-int8_t-int4", "d-fp16_t-int8", "odd-rows"])
def test_a_row_scores_the_same_alone_and_in_any_batch(
    bundles, precision_bundles, odd_rows_bundle, name
):
    """With the padding the engine probed for (the odd-rows target needs it on every machine;
    int8/int4 targets on some CPUs), every row matches itself alone, bit for bit."""
    paths = {**bundles, **precision_bundles, "odd-rows": odd_rows_bundle}
    assert mismatches(Bundle.load(paths[name])) == []


def test_a_row_whose_context_differs_is_caught_in_every_batch(bundles):
    """The control for the comparison: slot 2's context ends in another token in the batched
    engine than alone, so its row must be reported in every batch that holds it, and no other
    row with it."""
    found = mismatches(Bundle.load(bundles["llama"]), wrong_prefix=2)
    assert found == [(batch, 2) for batch in BATCHES if 2 in batch]


def test_without_padding_odd_rows_depend_on_their_batch(odd_rows_bundle):
    """The control for padding: a target whose odd calls differ (as MatMulNBits' one-row kernel
    does on AVX2), run without the padding its probe asks for, gives rows that depend on their
    batch."""
    assert mismatches(Bundle.load(odd_rows_bundle), even_rows=False)


def test_batched_calls_keep_per_row_lengths_and_rollback(bundles):
    engine = OrtEngine.from_bundle(Bundle.load(bundles["llama"]), "target", slots=3)
    engine.forward_rows([(0, [1, 2, 3]), (2, [4])])
    assert list(engine.lengths) == [3, 0, 1]  # slot 1 sat out: padded, length kept
    engine.rollback(1, slot=0)
    logits = engine.forward_rows([(0, [5, 6]), (1, [7, 8, 9])], last=1)
    assert [row.shape[0] for row in logits] == [1, 1]
    assert list(engine.lengths) == [3, 3, 1]


def test_bad_batched_calls_are_refused(bundles):
    engine = OrtEngine.from_bundle(Bundle.load(bundles["llama"]), "target", slots=2)
    with pytest.raises(ValueError, match="slot 2 does not exist"):
        engine.forward_rows([(2, [1])])
    with pytest.raises(ValueError, match="twice"):
        engine.forward_rows([(0, [1]), (0, [2])])
    with pytest.raises(SpecrtError, match="context full"):
        engine.forward_rows([(1, [1] * (engine.capacity + 1))])


def test_runtimes_over_slot_ranges_of_one_engine_are_each_their_own(bundles):
    """Two runtimes over halves of one pair of engines (a benchmark's runs sharing one copy of
    the weights) each answer what a runtime alone answers, in their own slots only; a slot
    outside a range, or a range outside the engine, is refused."""
    from specrt.engines.slot_range import SlotRange, split_slots
    from specrt.runtime import SpeculativeRuntime

    bundle = bundles["llama"]
    options = {"max_new_tokens": 20, "controller": "fixed:3"}
    alone = SpeculativeRuntime.load(bundle, calibrate=False, threads=2)
    want = alone.generate("def fibonacci(n):", **options).token_ids
    shared = SpeculativeRuntime.load(bundle, slots=4, calibrate=False, threads=2)
    halves = zip(split_slots(shared.draft, 2), split_slots(shared.target, 2), strict=True)
    first, second = (SpeculativeRuntime(shared.bundle, d, t) for d, t in halves)
    assert second.generate("def fibonacci(n):", **options).token_ids == want
    assert list(shared.target.lengths[:2]) == [0, 0] and shared.target.lengths[2] > 0
    held = list(shared.target.held(2))
    assert first.generate("def fibonacci(n):", **options).token_ids == want
    assert list(shared.target.held(2)) == held
    with pytest.raises(ValueError, match="slot 2 does not exist"):
        second.target.forward_rows([(2, [1])])
    with pytest.raises(ValueError, match="not all in an engine of 4"):
        SlotRange(shared.target, 3, 2)
    with pytest.raises(ValueError, match="equal ranges"):
        split_slots(shared.target, 3)


def test_caches_without_a_margin_serve_one_slot(bundles, tmp_path):
    """A padded row of a batched call writes past the longest row's context: without the margin
    for it, the engine holds one slot."""
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bundles["llama"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["kv_cache"]["margin"] = 0
    (old / "manifest.json").write_text(json.dumps(manifest))
    bundle = Bundle.load(old)
    assert OrtEngine.from_bundle(bundle, "target").slots == 1
    with pytest.raises(SpecrtError, match="rebuild the bundle"):
        OrtEngine.from_bundle(bundle, "target", slots=2)


REQUESTS = [  # (prompt, options): drafters, controllers and budgets of every kind, mixed
    ("def fibonacci(n):", {"max_new_tokens": 40}),
    ("a b c a b c a b c a b", {"max_new_tokens": 30, "drafter": "ngram"}),
    ("The quick brown fox", {"max_new_tokens": 25, "controller": "fixed:3"}),
    ("import numpy as np\nimport numpy as np\n", {"max_new_tokens": 35, "drafter": "hybrid"}),
    ("x = 1\ny = 2\n", {"max_new_tokens": 20, "speculate": False}),
    ("for i in range(10):", {"max_new_tokens": 45, "controller": "heuristic"}),
]


def test_every_request_in_a_batch_gives_its_output_alone(
    bundles, precision_bundles, odd_rows_bundle
):
    """Six requests through 3 slots (joining and leaving between rounds) against each run alone:
    greedy outputs must be identical, token for token, on a float32 and an int4 target, and on
    one whose odd calls differ (padded as its probe found)."""
    from specrt.runtime import SpeculativeRuntime

    for bundle in (bundles["llama"], precision_bundles["d-int8_t-int4"], odd_rows_bundle):
        runtime = SpeculativeRuntime.load(bundle, slots=3, calibrate=False, threads=2)
        requests = [(p, {"ignore_eos": True, **o}) for p, o in REQUESTS]
        alone, together, sizes = alone_and_together(runtime, requests, slots=3)
        assert together == alone
        assert {2, 3} <= sizes  # rounds of several requests really ran
