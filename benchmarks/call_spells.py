"""What a slow spell of a shared machine slows: the calls a round makes, timed side by side.

The adaptive policy prices a round as its draft steps plus one verify call, each part scaled
by how far the machine moved since calibration (runtime/costs.py: two drifts, the reads' and
the arithmetic's). Whether drafting pays turns on the gap between the call without drafts and
the wider call a round of drafts makes, and on the draft step; a spell that moves one and not
the other moves that choice. This times them within a second of each other, over and over:
B requests' target call of 1, 2 and 3 tokens each after CONTEXT tokens, and the draft model's
step of 1 and 2 tokens each after the window it reads (DRAFT_CONTEXT), in that order, so that
each pass meets one moment of the machine. The passes are then grouped by how long the call of
one token took (the spell) and, in each quarter, the wider calls' extra seconds and the draft
steps are given beside it.

The slots hold placeholder keys and values (costs.py's `fill_slots`): a call's time depends on
how many positions it reads, not on what they hold.

    python benchmarks/call_spells.py BUNDLE [--context 4000] [--requests 4] [--passes 150] \
        [--out benchmarks/results/cpu-call-spells-4k]
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import fill_slots, time_call
from specrt.runtime.drafters import DRAFT_WINDOW, SCOUT

DRAFT_CONTEXT = DRAFT_WINDOW + SCOUT + 16  # what a windowed draft model reads, about
CALLS = ("verify 1", "verify 2", "verify 3", "draft 1", "draft 2")


def passes(bundle: Path, context: int, requests: int, count: int) -> np.ndarray:
    """`count` passes over the calls, seconds each (a row a pass, a column a call of CALLS)."""
    rt = SpeculativeRuntime.load(bundle, slots=requests, calibrate=False, prompt_cache=False)
    fill_slots(rt.target, requests, context)
    fill_slots(rt.draft, requests, DRAFT_CONTEXT)
    calls = {f"verify {w}": (rt.target, context, requests, w) for w in (1, 2, 3)}
    calls |= {f"draft {w}": (rt.draft, DRAFT_CONTEXT, requests, w) for w in (1, 2)}
    order = ["verify 1", "draft 2", "draft 1", "verify 2", "verify 3"]  # narrow and wide apart
    rows = []
    for _ in range(count):
        seconds = {name: time_call(*calls[name]) for name in order}
        rows.append([seconds[name] for name in CALLS])
    return np.array(rows)


def quarters(times: np.ndarray) -> list[dict]:
    """The passes grouped by the one-token call's time, a quarter each: its range and the
    medians of what the others took."""
    one = times[:, 0]
    edges = np.quantile(one, [0, 0.25, 0.5, 0.75, 1.0])
    groups = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        rows = times[(one >= low) & (one <= high)]
        groups.append(
            {
                "verify_1": [float(low), float(high)],
                "verify_1_median": float(np.median(rows[:, 0])),
                "extra_2": float(np.median(rows[:, 1] - rows[:, 0])),
                "extra_3": float(np.median(rows[:, 2] - rows[:, 0])),
                "draft_1": float(np.median(rows[:, 3])),
                "draft_2": float(np.median(rows[:, 4])),
                "passes": len(rows),
            }
        )
    return groups


def markdown(result: dict) -> str:
    m, r = result["machine"], result["correlations"]
    lines = [
        "# What a slow spell slows: a round's calls timed side by side",
        "",
        f"{machine.label(m)}; {m['date']}; {result['requests']} requests after "
        f"{result['context']:,} tokens (the draft model after {result['draft_context']}); "
        f"{result['passes']} passes, each over every call. `{result['command']}`",
        "",
        "Passes grouped by the time of the call of one token a request (the spell), a quarter "
        "each; medians in ms.",
        "",
        "| call of 1 token | its median | 2 tokens: extra | 3 tokens: extra | draft step, "
        "1 token | draft step, 2 tokens |",
        "|---|---|---|---|---|---|",
    ]
    for q in result["quarters"]:
        low, high = q["verify_1"]
        lines.append(
            f"| {1e3 * low:.0f}-{1e3 * high:.0f} | {1e3 * q['verify_1_median']:.0f} | "
            f"{1e3 * q['extra_2']:.0f} | {1e3 * q['extra_3']:.0f} | {1e3 * q['draft_1']:.0f} | "
            f"{1e3 * q['draft_2']:.0f} |"
        )
    lines += [
        "",
        f"Correlation with the call of one token, pass by pass: the 2-token call's extra "
        f"{r['extra_2']:.2f}, the 3-token call's {r['extra_3']:.2f}, the draft step of 2 tokens "
        f"{r['draft_2']:.2f}.",
        "",
    ]
    return "\n".join(lines)


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--context", default=4000, show_default=True, help="Tokens before each call.")
@click.option("--requests", default=4, show_default=True, help="Slots in each call.")
@click.option("--passes", "count", default=150, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(bundle: Path, context: int, requests: int, count: int, out: Path | None) -> None:
    times = passes(bundle, context, requests, count)
    one = times[:, 0]
    result = {
        "kind": "call_spells",
        "command": f"python benchmarks/call_spells.py {bundle.name} --context {context} "
        f"--requests {requests} --passes {count}",
        "machine": machine.describe(),
        "context": context,
        "draft_context": DRAFT_CONTEXT,
        "requests": requests,
        "passes": count,
        "quarters": quarters(times),
        "correlations": {
            "extra_2": float(np.corrcoef(one, times[:, 1] - one)[0, 1]),
            "extra_3": float(np.corrcoef(one, times[:, 2] - one)[0, 1]),
            "draft_2": float(np.corrcoef(one, times[:, 4])[0, 1]),
        },
        "seconds": {name: times[:, i].round(5).tolist() for i, name in enumerate(CALLS)},
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
