"""Batch invariance: a row's logits do not depend on what else is in the call.

The same rows are scored alone (an engine holding one sequence) and inside batches of other
sizes, with ragged prefixes and ragged new tokens, and must give bit-identical logits; the
control shows the comparison fails when a kernel's numbers do depend on the batch."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.bundle import Bundle
from specrt.engines.onnxruntime import OrtEngine
from specrt.errors import SpecrtError

PREFIXES = [list(range(10, 17 + 3 * slot)) for slot in range(5)]  # 7, 10, 13, 16, 19 tokens
NEW = [list(range(60 + 5 * slot, 60 + 5 * slot + n)) for slot, n in enumerate([1, 3, 5, 2, 4])]
BATCHES = ([0, 1], [0, 1, 2], [1, 2, 3, 4], [0, 2, 4], [0, 1, 2, 3, 4], [3], [4, 1])


def _alone(bundle: Bundle, slot: int, **options) -> np.ndarray:
    engine = OrtEngine.from_bundle(bundle, "target", threads=2, **options)
    engine.forward(PREFIXES[slot], last=1)
    return engine.forward(NEW[slot])


def _mismatches(bundle: Bundle, **options) -> list[tuple[list[int], int]]:
    """(batch, slot) for every row whose batched logits differ from the row alone."""
    alone = [_alone(bundle, slot, **options) for slot in range(5)]
    engine = OrtEngine.from_bundle(bundle, "target", threads=2, slots=5, **options)
    found = []
    for batch in BATCHES:
        for slot, prefix in enumerate(PREFIXES):
            engine.reset(slot)
            engine.forward_rows([(slot, prefix)], last=1)
        rows = engine.forward_rows([(slot, NEW[slot]) for slot in batch])
        found += [
            (batch, s)
            for s, row in zip(batch, rows, strict=True)
            if not np.array_equal(row, alone[s])
        ]
    return found


@pytest.mark.parametrize("name", ["llama", "qwen2", "d-int8_t-int4", "d-fp16_t-int8"])
def test_a_row_scores_the_same_alone_and_in_any_batch(bundles, precision_bundles, name):
    bundle = Bundle.load(bundles[name] if name in bundles else precision_bundles[name])
    assert _mismatches(bundle) == []


def test_without_even_rows_an_int4_row_depends_on_its_batch(precision_bundles):
    """The control: MatMulNBits' one-row kernel differs from its pair kernel, so a row alone
    (odd) and the same row beside another (paired) disagree when calls are not kept even."""
    bundle = Bundle.load(precision_bundles["d-int8_t-int4"])
    assert _mismatches(bundle, even_rows=False)


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


def test_a_bundle_from_before_per_row_positions_serves_one_slot(bundles, tmp_path):
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bundles["llama"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["kv_cache"]
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


def test_every_request_in_a_batch_gives_its_output_alone(bundles, precision_bundles):
    """Six requests through 3 slots (joining and leaving between rounds) against each run alone:
    greedy outputs must be identical, token for token, on a float32 and an int4 target."""
    from specrt.runtime import Scheduler, SpeculativeRuntime

    for bundle in (bundles["llama"], precision_bundles["d-int8_t-int4"]):
        runtime = SpeculativeRuntime.load(bundle, slots=3, calibrate=False, threads=2)
        alone = [runtime.generate(p, ignore_eos=True, **o).token_ids for p, o in REQUESTS]
        scheduler = Scheduler(runtime.target, runtime.costs, slots=3)
        generations = [runtime.stream(p, ignore_eos=True, **o) for p, o in REQUESTS]
        for generation in generations:
            scheduler.add(generation)
        sizes = set()
        while any(g.result is None for g in generations):
            sizes.add(scheduler.step().batch)
        assert [g.result.token_ids for g in generations] == alone
        assert {2, 3} <= sizes  # rounds of several requests really ran
