"""Whether adaptive holds its goal in a benchmark cell (GOAL x the best of the configurations
run beside it), given how far the cell's turns spread: it holds, it misses, or the turns
cannot tell yet, and how many turns of the same spread would.

A cell's table gives one ratio: adaptive's mean speed over the best mean of the others. On a
shared 2-core machine that ratio moves more than the goal's 3 % between runs of the same code
(five runs of a summary after 1,000 tokens, one request, on an AMX Xeon: 0.946-1.003x fixed
K = 1), and the best of several noisy means flatters the denominator.
Here each turn is one paired sample: its runs ran side by side (long_context.py interleaves
them round by round, `specrt bench --concurrency` runs them one after another within the
turn), so a slow spell that falls on a turn falls on all of them. Against each other
configuration the turns' log ratios ln(adaptive / other) give a mean and one-sided bounds
(Student's t at LEVEL): the goal holds against it where the lower bound clears ln GOAL, and
is missed where the upper bound falls under it. A cell holds where it holds against every
other configuration (an intersection: each lower bound at LEVEL), misses where it misses
against any (a union: each upper bound at 1 - (1 - LEVEL) / comparisons, Bonferroni), and is
within noise otherwise.

Limits: a batch's turns share its runtime's acceptance pool (its first turn is cold, the
rest warm) and a run's turns one calibration, so turns are not quite independent; the bounds
are as good as that. Pooling runs of one cell (several files) assumes the same code.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

GOAL = 0.97  # adaptive's speed over the best other configuration's, at least (issue 54)
LEVEL = 0.95  # one-sided confidence of each claim
SETTLE_CAP = 100_000  # turns past which a cell is said to take forever to settle
HOLDS, MISSES, OPEN = "holds", "misses", "within noise"


def _t(level: float, df: int) -> float:
    """Student's t quantile at a one-sided `level` (scipy's ufunc: stats.t.ppf's checks cost
    ~1.5 ms a call, and a table of the docs asks for hundreds)."""
    try:
        from scipy.special import stdtrit
    except ImportError as err:
        raise SpecrtError("specrt verdict needs scipy: pip install 'specrt[bench]'") from err
    return float(stdtrit(df, level))


def _turns_to_settle(sd: float, gap: float, level: float, n: int) -> float:
    """The fewest turns, more than `n` (which do not settle it), whose one-sided bound at
    `level` would lie within `gap` of the mean at this spread `sd` (inf past SETTLE_CAP). The
    bound shrinks as turns grow, so a bisection finds it: every table row of the docs asks."""

    def settled(turns: int) -> bool:
        return _t(level, turns - 1) * sd / math.sqrt(turns) < gap

    if not settled(SETTLE_CAP):
        return math.inf
    unsettled, enough = n, SETTLE_CAP
    while enough - unsettled > 1:
        middle = (unsettled + enough) // 2
        unsettled, enough = (unsettled, middle) if settled(middle) else (middle, enough)
    return float(enough)


@dataclass(frozen=True)
class Against:
    """Adaptive against one other configuration over the turns they shared."""

    other: str
    turns: int
    ratio: float  # the turns' geometric mean of adaptive / other
    low: float  # its one-sided lower bound at LEVEL (nan with fewer than 2 turns)...
    high: float  # ...and upper bound at LEVEL over the cell's comparisons (Bonferroni)
    missed: bool  # that upper bound is under the goal
    needed: float  # turns of this spread that would settle it (0: settled; inf: too many)

    @property
    def holds(self) -> bool:
        return self.low >= GOAL


@dataclass(frozen=True)
class Verdict:
    """A cell's verdict: HOLDS against every other configuration, MISSES against one, or
    OPEN (within noise)."""

    cell: str
    turns: int
    point: float  # adaptive's mean speed over the best other mean (the tables' kind of ratio)
    state: str  # HOLDS, MISSES or OPEN
    against: tuple[Against, ...]

    @property
    def binding(self) -> Against:
        """The comparison that decides the cell: a miss, else the lowest bound."""
        missed = [a for a in self.against if a.missed]
        return min(missed or self.against, key=lambda a: a.low if a.turns > 1 else a.ratio)

    @property
    def needed(self) -> float:
        """Turns of this spread that would settle the cell if its means held (0: settled): a
        miss needs one comparison whose mean is under the goal to settle, a hold needs all."""
        if any(a.turns < 2 for a in self.against):
            return math.nan
        open_ = [a for a in self.against if not a.holds and not a.missed]
        under = [a.needed for a in open_ if a.ratio < GOAL]
        return min(under) if under else max((a.needed for a in open_), default=0.0)


def against(other: str, mine: list[float], theirs: list[float], comparisons: int) -> Against:
    """Adaptive's turns `mine` against another configuration's `theirs`, paired by turn."""
    logs = np.log(np.asarray(mine, float)) - np.log(np.asarray(theirs, float))
    n, mean, goal = len(logs), float(logs.mean()), math.log(GOAL)
    if n < 2:
        nan = float("nan")  # one turn has no spread: nothing to bound, nothing to count
        return Against(other, n, math.exp(mean), nan, nan, False, nan)
    sd = float(logs.std(ddof=1))
    se, miss_level = sd / math.sqrt(n), 1 - (1 - LEVEL) / comparisons
    low, high = mean - _t(LEVEL, n - 1) * se, mean + _t(miss_level, n - 1) * se
    missed = high < goal
    needed = 0.0
    if low < goal and not missed:  # open: the turns at which this mean would settle it
        needed = _turns_to_settle(sd, abs(mean - goal), LEVEL if mean >= goal else miss_level, n)
    return Against(other, n, math.exp(mean), math.exp(low), math.exp(high), missed, needed)


def judge(cell: str, turns: list[dict[str, float]]) -> Verdict:
    """A cell's verdict from its turns, each {configuration: tokens/s}, adaptive's under
    "adaptive" (turns of several runs of the cell may be pooled)."""
    names = list(dict.fromkeys(n for turn in turns for n in turn if n != "adaptive"))
    mine = [turn for turn in turns if "adaptive" in turn]
    if not mine or not names:  # nothing to judge: no adaptive run, or nothing beside it
        return Verdict(cell, len(mine), math.nan, OPEN, ())
    pairs = {n: [(t["adaptive"], t[n]) for t in mine if n in t] for n in names}
    pairs = {n: p for n, p in pairs.items() if p}  # those that shared a turn with adaptive
    results = tuple(
        against(n, [a for a, _ in p], [o for _, o in p], len(pairs)) for n, p in pairs.items()
    )
    point = float(_mean(turns, "adaptive") / _mean(turns, _best(turns, names)))
    return Verdict(cell, len(mine), point, _state(results), results)


def _mean(turns: list[dict[str, float]], name: str) -> float:
    return float(np.mean([t[name] for t in turns if name in t]))


def _best(turns: list[dict[str, float]], names) -> str:
    """The other configuration with the best mean speed over a cell's turns."""
    return max(names, key=lambda n: _mean(turns, n))


def _state(results: tuple[Against, ...]) -> str:
    """MISSES against any comparison, HOLDS against every one, else OPEN."""
    if any(a.missed for a in results):
        return MISSES
    return HOLDS if results and all(a.holds for a in results) else OPEN


def cells(result: dict) -> dict[str, list[dict[str, float]]]:
    """The turns of each cell of a result file (long_context.py's `--speculation` rows with
    `--runs`, or `specrt bench --concurrency`), keyed by the CPU and the cell."""
    where = _cpu(result.get("machine", {}))
    out: dict[str, list[dict[str, float]]] = {}
    if result.get("kind") == "concurrency":
        entries = result["configs"]
        levels = dict.fromkeys((e["bundle"], e["concurrency"]) for e in entries)
        for bundle, level in levels:
            if bundle != "llama.cpp":  # its own rows: the goal is against specrt's
                key = f"{where}: short prompts, {bundle}, {level} client(s)"
                out[key] = level_turns(entries, bundle, level)
        return out
    clients = result.get("clients", 1)
    for row in result.get("rows", []):
        key = f"{where}: {result.get('task', 'chat')}, {clients} client(s), {row['size']:,} tokens"
        out[key] = row_turns(row, result.get("runs", []))
    return out


def row_turns(row: dict, runs: list[str]) -> list[dict[str, float]]:
    """A long_context.py row's turns: each {run: tokens/s}, of the target alone, the fixed
    K runs and adaptive (not adaptive's other forms, `whole` and `unscouted`)."""
    turns: list[dict[str, float]] = []
    for name in runs:
        if name in row and (name in ("target", "adaptive") or name.startswith("fixed")):
            _merge(turns, name, row[name].get("turns") or [row[name]["decode_tokens_per_s"]])
    return turns


def level_turns(entries: list[dict], bundle: str, level: int) -> list[dict[str, float]]:
    """A `specrt bench --concurrency` level's turns: each {configuration: tokens/s}."""
    turns: list[dict[str, float]] = []
    for e in entries:
        if e["bundle"] == bundle and e["concurrency"] == level:
            _merge(turns, e["config"], e.get("aggregate_runs", [e["aggregate_tokens_per_s"]]))
    return turns


def brief(turns: list[dict[str, float]]) -> str:
    """A cell's verdict in a table cell: the state, and its binding comparison's ratio and
    bounds (the turns that would tell, where it is within noise)."""
    v = judge("", turns)
    if not v.against or v.turns < 2:
        return "–"
    b, tell = v.binding, _to_tell(v)
    state = v.state + (f" (turns to tell: {tell})" if tell != "–" else "")
    return f"{state}: {b.other} {b.ratio:.3f}× [{b.low:.3f}, {b.high:.3f}]"


def report(paths: list[Path], pool: bool = True) -> str:
    """The verdict of every cell with an adaptive run in these result files, as Markdown: a
    cell found in several files judged on all their turns (`pool`), or each file apart; and
    with two cells or more, a last row for all their turns together (`together`)."""
    groups: dict[str, list[dict[str, float]]] = {}
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
            found = cells(result)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise SpecrtError(f"{path}: not a benchmark result specrt can judge ({err!r})") from err
        for key, turns in found.items():
            groups.setdefault(key if pool else f"{Path(path).stem}, {key}", []).extend(turns)
    judged = [v for v in (judge(k, t) for k, t in groups.items()) if v.against]
    if not judged:
        raise SpecrtError(
            "no cell with an adaptive run in these files: pass the JSON of "
            "`long_context.py --speculation --runs ...,adaptive` or `specrt bench --concurrency`"
        )
    whole = together(groups)
    return markdown(judged + ([whole] if whole else []))


def together(groups: dict[str, list[dict[str, float]]]) -> Verdict | None:
    """Every cell's turns as one sample, each turn's adaptive against its cell's best other
    configuration by mean (the tables' denominator); None under two cells. A grid whose cells
    are each within noise on five turns can be told on all of them: how adaptive does across
    these prompts and loads, not in any one of them (a cell that misses is not saved by it)."""
    mine, theirs, cells_ = [], [], 0
    for turns in groups.values():
        names = {n for turn in turns for n in turn if n != "adaptive"}
        paired = [t for t in turns if "adaptive" in t]
        if not names or not paired:
            continue
        best = _best(turns, names)
        pairs = [(t["adaptive"], t[best]) for t in paired if best in t]
        mine += [a for a, _ in pairs]
        theirs += [o for _, o in pairs]
        cells_ += 1
    if cells_ < 2:
        return None
    a = against("each cell's best", mine, theirs, 1)
    return Verdict(f"all {cells_} cells together", len(mine), a.ratio, _state((a,)), (a,))


def markdown(verdicts: list[Verdict]) -> str:
    lines = [
        f"Adaptive against its goal ({GOAL:.2f}x the best other configuration). Means' ratio: "
        "adaptive's mean speed over the best other mean. Binding: the comparison that decides "
        "the cell, paired by turn: its geometric mean ratio, its lower bound at "
        f"{LEVEL:.0%} and its upper bound at {LEVEL:.0%} over the cell's comparisons. "
        "Turns: how many of this spread would settle a cell within noise, if its mean held.",
        "",
        "| cell | turns | means' ratio | binding: against, ratio [low, high] | verdict | turns |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        b = v.binding
        bounds = "" if b.turns < 2 else f" [{b.low:.3f}, {b.high:.3f}]"
        lines.append(
            f"| {v.cell} | {v.turns} | {v.point:.3f}× | {b.other}, {b.ratio:.3f}×{bounds} "
            f"| {v.state} | {_to_tell(v)} |"
        )
    return "\n".join(lines) + "\n"


def _to_tell(v: Verdict) -> str:
    """The turns that would settle a cell within noise, as a table shows them."""
    if v.state != OPEN or math.isnan(v.needed):
        return "–"
    return "over 1,000" if v.needed > 1000 else f"{v.needed:.0f}"


def _merge(turns: list[dict[str, float]], name: str, runs: list[float]) -> None:
    """One configuration's turn speeds into a cell's turns, the i-th into the i-th."""
    while len(turns) < len(runs):
        turns.append({})
    for turn, speed in zip(turns, runs, strict=False):
        turn[name] = float(speed)


def _cpu(m: dict) -> str:
    simd = "AMX" if "AMX" in " ".join(m.get("simd", [])) else "no AMX"
    return f"{m.get('cpu', 'CPU?')} ({simd})"
