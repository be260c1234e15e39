"""What a calibration's error costs the adaptive policy: answers replayed with the policy pricing
its rounds on a verify curve in error, the rounds timed on the true one.

Whether a request alone drafts turns on a few milliseconds: after 4,000 tokens on a 2-core EPYC,
the call of 2 tokens took 1.10-1.15x the call of one where a draft step cost ~0.16x, so a round
at K = 1 paid from an acceptance of about 0.3. Calibration times those calls for ~10 seconds
at load on a shared machine, and across the committed runs it priced that ratio 1.00-1.24x
(`c_verify(K)/c_verify(0)` in each run's reasons). A lone question after 4,000 tokens priced
it 1.21-1.24x in two runs and stopped on a dip of its acceptance where fixed K = 1 went on to
keep 12 of its next 16 drafts (0.91x and 0.955x fixed K = 1). This puts a number on what such
an error costs each kind of answer, with no clock (tools/replay.py): the policy prices a
call's arithmetic, the curve above one row, at FACTOR times the truth's, the draft steps
right (the runtime times those itself, round by round).

The answers: tests/data/acceptance-long-prompts.json's 40 (the default pair after long
prompts, by group), and 20 made up at each of a few acceptances (each draft kept at random with
that probability, seed 0), 128 tokens each, every answer alone with a fresh acceptance pool (as
benchmarks/long_context.py serves one request). Each is priced on one curve, the EPYC's after
4,000 tokens (VERIFY, DRAFT), whatever its prompt's length. Each cell: adaptive's tokens per
second over the best of fixed K = 0, 1 and 2 on the true curve, its answers' mean [lowest].

    python benchmarks/price_error.py [--factors 0.4,1,1.75] [--out benchmarks/results/X]
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.files import write_result
from specrt.runtime.costs import StepCosts
from specrt.runtime.pool import PooledAcceptance
from specrt.tools import replay

HERE = Path(__file__).resolve().parent
ANSWERS = HERE.parent / "tests" / "data" / "acceptance-long-prompts.json"
GROUPS = {  # the answers of ANSWERS, by prompt (see tests/test_replay.py)
    "question, 4k": range(0, 4),
    "summary, 4k": range(4, 8),
    "system, 1k": range(8, 12),
    "summary, 8k": range(12, 16),
    "all three, 1k": range(16, 40),
}
ACCEPTANCES = (0.1, 0.2, 0.3, 0.45)
# One request after 4,000 tokens on a 2-core AVX-512 EPYC (benchmarks/call_spells.py's calls,
# timed side by side): the call of 1, 2 and 3 tokens 87 ms, 1.12x and 1.33x it, ~0.19x more a
# token after; the draft curve calibrated at 8 slots (tests/fixed_costs.py's gguf_costs) and
# one catch-up of 33 tokens (113 ms in a calibration of that machine).
ONE = 0.087
VERIFY = {1: 1.0, 2: 1.12, 3: 1.33, **{n: 1.33 + 0.19 * (n - 3) for n in range(4, 10)}}
DRAFT = {1: 0.0138, 2: 0.0166, 4: 0.0257, 8: 0.0403, 16: 0.0635, 33: 0.113}


def curve(factor: float) -> StepCosts:
    """The costs with each call's arithmetic (its time above the call of one token) times
    `factor` (a replay refines no curve: the policy sees them as given)."""
    verify = {n: ONE * (1 + factor * (ratio - 1)) for n, ratio in VERIFY.items()}
    return StepCosts(draft=dict(DRAFT), verify=verify)


def answers() -> dict[str, list[replay.Trace]]:
    """The recorded answers by group, then the made-up ones by acceptance."""
    recorded = replay.load(ANSWERS)
    sets = {name: [recorded[i] for i in indices] for name, indices in GROUPS.items()}
    rng = np.random.default_rng(0)
    for p in ACCEPTANCES:
        made = [list(map(bool, rng.random(128) < p)) for _ in range(20)]
        sets[f"kept at {p}"] = [replay.Trace(4040, agrees, [0.9] * 128) for agrees in made]
    return sets


def speed(trace: replay.Trace, controller: str, priced: StepCosts, truth: StepCosts) -> float:
    """Tokens per second of one answer alone, chosen on `priced` and timed on `truth`."""
    one = replay.replay([trace], controller, 1, priced, pool=PooledAcceptance(), truth=truth)
    return one.tokens_per_s


def best_fixed(traces: list[replay.Trace], truth: StepCosts) -> list[float]:
    """Each answer's speed at the best fixed K (0-2) on `truth`: no fixed K reads a price, so
    one list serves every factor."""
    return [max(speed(t, f"fixed:{k}", truth, truth) for k in range(3)) for t in traces]


def markdown(result: dict) -> str:
    m, names = result["machine"], list(result["rows"][0]["cells"])
    lines = [
        "# What a calibration's error costs: adaptive priced on a curve in error, replayed",
        "",
        f"Replayed on {machine.label(m)}; {m['date']}; the curves of one request after 4,000 "
        "tokens on a 2-core AVX-512 EPYC. Each cell: adaptive over the best fixed K (0-2), its "
        f"answers' mean [lowest], each answer alone. `{result['command']}`",
        "",
        "| arithmetic priced | 2-token call priced | " + " | ".join(names) + " |",
        "|---" * (len(names) + 2) + "|",
    ]
    for row in result["rows"]:
        cells = " | ".join(f"{c['mean']:.3f} [{c['lowest']:.3f}]" for c in row["cells"].values())
        lines.append(f"| {row['factor']}x | {row['priced_2']:.2f}x | {cells} |")
    return "\n".join([*lines, ""])


@click.command()
@click.option("--factors", default="0.4,1,1.75", show_default=True, help="Arithmetic priced at.")
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(factors: str, out: Path | None) -> None:
    truth, sets, rows = curve(1.0), answers(), []
    best = {name: best_fixed(traces, truth) for name, traces in sets.items()}
    for factor in [float(f) for f in factors.split(",")]:
        priced = curve(factor)
        cells = {}
        for name, traces in sets.items():
            pairs = zip(traces, best[name], strict=True)
            got = [speed(t, "adaptive", priced, truth) / b for t, b in pairs]
            cells[name] = {"mean": float(np.mean(got)), "lowest": float(np.min(got))}
        rows.append({"factor": factor, "priced_2": priced.verify[2] / ONE, "cells": cells})
    result = {
        "kind": "price_error",
        "command": f"python benchmarks/price_error.py --factors {factors}",
        "machine": machine.describe(),
        "rows": rows,
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
