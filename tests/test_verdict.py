"""`specrt verdict`: a benchmark cell is judged on its turns' spread, paired by turn, so that a
ratio a few percent from the goal is called within noise instead of met or missed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from specrt.cli import cli
from specrt.tools import verdict

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"
LONG = RESULTS / "cpu-long-context-epyc-once-clients-summary-8k.json"  # 4 runs, 3 turns
SHORT = RESULTS / "cpu-short-prompts-epyc-margin.json"  # specrt bench --concurrency, 4 levels


def _turns(ratios, base=10.0, drift=None) -> list[dict[str, float]]:
    """Turns where adaptive runs `ratios` x fixed K = 1, the target alone 0.8x it, and each
    turn's machine `drift` x as fast for every run (paired: it falls on all alike)."""
    drift = drift or [1.0] * len(ratios)
    return [
        {"target": 0.8 * base * d, "fixed:1": base * d, "adaptive": r * base * d}
        for r, d in zip(ratios, drift, strict=True)
    ]


def _spread(mean: float, sd: float, n: int) -> list[float]:
    """n ratios whose logs have exactly this mean and sample standard deviation."""
    z = np.linspace(-1, 1, n)
    z = (z - z.mean()) / z.std(ddof=1)
    return list(np.exp(math.log(mean) + sd * z))


def test_a_cell_close_above_the_goal_holds_with_a_narrow_spread_and_is_open_with_a_wide_one():
    held = verdict.judge("cell", _turns(_spread(0.99, 0.005, 3)))
    assert held.state == verdict.HOLDS and held.binding.other == "fixed:1"
    wide = verdict.judge("cell", _turns(_spread(0.99, 0.04, 3)))  # control: the same mean
    assert wide.state == verdict.OPEN
    assert wide.binding.low < verdict.GOAL < wide.binding.high


def test_a_cell_clearly_under_the_goal_misses():
    missed = verdict.judge("cell", _turns(_spread(0.90, 0.01, 3)))
    assert missed.state == verdict.MISSES and missed.binding.missed
    assert abs(missed.binding.ratio - 0.90) < 1e-9


def test_the_turns_it_asks_for_settle_a_cell_whose_mean_holds():
    for mean, settled in ((0.985, verdict.HOLDS), (0.955, verdict.MISSES)):
        open_ = verdict.judge("cell", _turns(_spread(mean, 0.03, 3)))
        assert open_.state == verdict.OPEN and open_.needed > 3
        more = verdict.judge("cell", _turns(_spread(mean, 0.03, int(open_.needed))))
        assert more.state == settled
        fewer = verdict.judge("cell", _turns(_spread(mean, 0.03, int(open_.needed) - 1)))
        assert fewer.state == verdict.OPEN  # the fewest that do


def test_a_cell_leaning_to_a_miss_is_settled_by_its_losing_comparison_alone():
    """Under fixed K = 1 at 0.93x and at 0.99x the target alone, turns spread wide: the turns
    that would tell are those that settle the miss, fewer than the hold against the target
    alone would take (control: what every comparison would take)."""
    ratios = _spread(0.93, 0.05, 3)
    turns = [{**t, "target": t["fixed:1"] * 0.94} for t in _turns(ratios)]
    v = verdict.judge("cell", turns)
    losing, other = (next(a for a in v.against if a.other == n) for n in ("fixed:1", "target"))
    assert v.state == verdict.OPEN and other.needed > losing.needed > 3
    assert v.needed == losing.needed


def test_a_slow_spell_that_falls_on_a_whole_turn_cancels_out():
    """Paired by turn, a turn 40 % slower for every run moves no ratio; the same speeds with
    adaptive's turns out of step with the others' (control) are within noise."""
    drift = [1.0, 0.6, 1.0]
    paired = _turns([0.99, 0.99, 0.99], drift=drift)
    assert verdict.judge("cell", paired).state == verdict.HOLDS
    shifted = [dict(t) for t in paired]
    for turn, other in zip(shifted, paired[1:] + paired[:1], strict=True):
        turn["adaptive"] = other["adaptive"]
    assert verdict.judge("cell", shifted).state == verdict.OPEN


def test_one_turn_bounds_nothing_and_a_cell_without_adaptive_is_not_judged():
    one = verdict.judge("cell", _turns([1.2]))
    assert one.state == verdict.OPEN and math.isnan(one.binding.low) and math.isnan(one.needed)
    assert "| within noise | – |" in verdict.markdown([one])
    without = [{k: v for k, v in turn.items() if k != "adaptive"} for turn in _turns([1.0, 1.0])]
    assert verdict.judge("cell", without).against == () and verdict.brief(without) == "–"


def test_cells_are_read_from_both_benchmarks_and_pooled_across_files():
    long = verdict.cells(json.loads(LONG.read_text()))
    ((key, turns),) = long.items()
    assert "AMD EPYC" in key and "summary, 4 client(s), 8,000 tokens" in key
    assert len(turns) == 3 and set(turns[0]) == {"target", "fixed:1", "fixed:2", "adaptive"}
    assert turns[0]["adaptive"] == 12.06  # the first turn's speeds, as the table gives them
    short = verdict.cells(json.loads(SHORT.read_text()))
    assert [k.rsplit(", ", 1)[1] for k in short] == [f"{n} client(s)" for n in (1, 2, 4, 8)]
    configurations = {"target_only", "fixed_1", "fixed_2", "adaptive"}
    assert all(set(turn) == configurations for turns in short.values() for turn in turns)
    pooled = verdict.report([LONG, LONG, SHORT])
    assert pooled.count("summary, 4 client(s), 8,000 tokens | 6 |") == 1
    apart = verdict.report([LONG, SHORT], pool=False)
    assert f"{LONG.stem}, AMD EPYC" in apart and apart.count("short prompts") == 4


def test_cells_each_within_noise_are_told_on_all_their_turns_together():
    """Two cells of three turns at 0.99x their best, each within noise at this spread: all
    six turns hold. Control: one cell alone gets no such row, and a cell whose best is the
    target alone is paired with it, not with fixed K = 1."""
    ratios = _spread(0.99, 0.015, 3)
    first = _turns(ratios)
    second = [{**t, "target": t["fixed:1"] * 1.1} for t in _turns(ratios, base=20.0)]
    second = [{**t, "adaptive": t["target"] * r} for t, r in zip(second, ratios, strict=True)]
    cells = {"first": first, "second": second}
    assert all(verdict.judge(k, t).state == verdict.OPEN for k, t in cells.items())
    whole = verdict.together(cells)
    assert whole.cell == "all 2 cells together" and whole.turns == 6
    assert whole.state == verdict.HOLDS and abs(whole.point - 0.99) < 1e-9
    assert verdict.together({"first": first}) is None


def test_the_command_judges_files_and_names_one_it_cannot_read(tmp_path):
    done = CliRunner().invoke(cli, ["verdict", str(LONG)])
    assert done.exit_code == 0, done.output
    assert "| 3 | 0.991× | fixed:2, 0.991× [" in done.output
    notes = tmp_path / "notes.json"
    notes.write_text("not json")
    bad = CliRunner().invoke(cli, ["verdict", str(notes)])
    assert bad.exit_code == 1 and "notes.json: not a benchmark result" in bad.output
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"kind": "long_context", "rows": []}))
    none = CliRunner().invoke(cli, ["verdict", str(empty)])
    assert none.exit_code == 1 and "no cell with an adaptive run" in none.output
