"""benchmarks/ceilings.py prices rounds as the controller does and keeps the best K: drafting
pays where the verify call's extra rows are nearly free, and not where every row costs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specrt.runtime.costs import StepCosts

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "ceilings.py"


@pytest.fixture(scope="module")
def ceilings():
    spec = importlib.util.spec_from_file_location("ceilings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drafting_pays_only_where_extra_rows_are_cheap(ceilings):
    flat = StepCosts(draft={1: 0.01, 8: 0.012}, verify={n: 0.1 for n in range(1, 80)})
    rate, k = ceilings.best_round(flat, 1, 0.8, 8)
    assert k > 0 and rate > 1 / 0.1
    steep = StepCosts(draft={1: 0.01, 8: 0.02}, verify={n: 0.1 * n for n in range(1, 80)})
    rate, k = ceilings.best_round(steep, 8, 0.8, 8)
    assert k == 0 and rate == pytest.approx(8 / 0.8)  # the batched target alone


def test_the_table_has_a_row_per_batch(ceilings):
    costs = StepCosts(draft={1: 0.01, 8: 0.02}, verify={n: 0.1 + 0.01 * n for n in range(1, 80)})
    lines = ceilings.table(costs, [1, 8], [0.5, 0.9], 8)
    assert len(lines) == 4 and lines[2].startswith("| 1 | ") and lines[3].startswith("| 8 | ")
    assert lines[1].count("|---") == 4
