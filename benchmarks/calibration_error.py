"""How far calibration prices the narrow calls wrong after a long context, load by load.

Whether a request drafts after a long prompt turns on how much dearer the target's call of 2 or
3 tokens is than its call of one (`c_verify(K)/c_verify(0)` in the adaptive policy's reasons).
Calibration once priced that from its model alone (runtime/costs.py: a curve timed after 48
tokens, the fastest of two passes, and a context term linear in the rows), and a lone question
after 4,000 tokens ran 0.90-0.99x fixed K = 1 as calibration's draw priced the 2-token call
1.04-1.24x (docs/limits.md); now it times those calls at knots of context too
(`measure_narrow`). This puts a number on the draw: each load (a fresh runtime, one slot)
calibrates as a runtime does, then its calls of 1, 2 and 3 tokens after each CONTEXT are timed
back to back, rotated `--rotations` times (each width first in turn), and their medians are
the truth it is compared with, beside the same load's model alone. A spell of the machine falls
on a rotation's three calls alike. Contexts off the knots (3,000, 6,000) judge the
interpolation between them.

With `--clients N`, each load is a runtime of N slots (a server's `--max-batch`), calibrated as
such a server is, and each call timed carries N requests of 1, 2 or 3 tokens each, after the
context in every slot: what a batch after long prompts chooses between. Calibration times the
narrow calls for one request only, and prices a batch's from them and its model.

The slot holds placeholder keys and values (costs.py's `fill_slots`): a call's time depends on
how many positions it reads, not on what they hold.

    python benchmarks/calibration_error.py BUNDLE [--loads 6] \
        [--contexts 1040,3000,4040,6000,8040] [--rotations 16] [--clients 1] \
        [--out benchmarks/results/cpu-calibration-error]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import fill_slots, time_rotated

WIDTHS = (1, 2, 3)  # K = 0, 1, 2: what a request after a long prompt chooses between


def timed_ratios(engine, context: int, rotations: int, clients: int) -> dict[int, float]:
    """Each width's median call over the 1-token call's, after `context` tokens, for
    `clients` requests at once."""
    medians = time_rotated(engine, context, list(WIDTHS), rotations, clients)
    return {w: medians[w] / medians[1] for w in WIDTHS[1:]}


def one_load(bundle: Path, contexts: list[int], rotations: int, clients: int) -> dict:
    """A fresh runtime's calibrated ratios at each context, the same costs' ratios without
    the narrow calls timed at the knots (the model alone: the comparison in one load), and
    the timed ones; for `clients` requests a call, each after the context (a runtime of that
    many slots, calibrated as a server's is)."""
    rt = SpeculativeRuntime.load(bundle, slots=clients, calibrate=False, prompt_cache=False)
    costs = rt.calibrate()
    modelled = dataclasses.replace(costs, narrow={})
    fill_slots(rt.target, clients, max(contexts))
    load = {}
    for context in sorted(contexts, reverse=True):  # each call rolls the slots back
        load[context] = {"timed": timed_ratios(rt.target, context, rotations, clients)}
        for name, priced in (("priced", costs), ("modelled", modelled)):
            priced.context = context
            one = priced.verify_cost(clients, clients)
            load[context][name] = {
                w: priced.verify_cost(clients * w, clients) / one for w in WIDTHS[1:]
            }
    return load


def summary(loads: list[dict], contexts: list[int]) -> list[dict]:
    """Per context and width: the ranges, and calibration's error against the timed ratio."""
    rows = []
    for context in contexts:
        for width in WIDTHS[1:]:
            priced = np.array([load[context]["priced"][width] for load in loads])
            timed = np.array([load[context]["timed"][width] for load in loads])
            modelled = np.array([load[context]["modelled"][width] for load in loads])
            error = priced - timed
            rows.append(
                {
                    "context": context,
                    "width": width,
                    "priced": [float(priced.min()), float(priced.max())],
                    "timed": [float(timed.min()), float(timed.max())],
                    "rms": float(np.sqrt((error**2).mean())),
                    "mean_error": float(error.mean()),
                    "correlation": float(np.corrcoef(priced, timed)[0, 1])
                    if len(loads) > 2
                    else None,
                    "modelled_rms": float(np.sqrt(((modelled - timed) ** 2).mean())),
                }
            )
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# How far calibration prices the narrow calls wrong, load by load",
        "",
        f"{machine.label(m)}; {m['date']}; {result['loads']} loads of {_slots(result)}, each "
        f"calibrated then its calls of 1-3 tokens a request rotated {result['rotations']} times "
        f"at each context (medians). `{result['command']}`",
        "",
        "| context | call of | calibration prices it | timed | error, root mean square | "
        "mean error | correlation | without the knots: RMS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        corr = "–" if row["correlation"] is None else f"{row['correlation']:.2f}"
        modelled = row.get("modelled_rms")  # results before the knots have no second price
        lines.append(
            f"| {row['context']:,} | {row['width']} tokens | {row['priced'][0]:.3f}-"
            f"{row['priced'][1]:.3f}x | {row['timed'][0]:.3f}-{row['timed'][1]:.3f}x | "
            f"{row['rms']:.3f} | {row['mean_error']:+.3f} | {corr} | "
            f"{'–' if modelled is None else f'{modelled:.3f}'} |"
        )
    lines += [
        "",
        "Each ratio is over the call of one token at the same context. Without the knots: the "
        "same load's costs priced by the model alone (`StepCosts.narrow` emptied), as before "
        "the narrow calls were timed at 1,024, 2,048, 4,096 and 8,192 tokens.",
        "",
    ]
    return "\n".join(lines)


def _slots(result: dict) -> str:
    clients = result.get("clients", 1)  # results before --clients timed one request
    return "one slot" if clients == 1 else f"{clients} slots, {clients} requests a call"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--loads", default=6, show_default=True, help="Fresh runtimes, one after another.")
@click.option("--contexts", default="1040,3000,4040,6000,8040", show_default=True)
@click.option("--rotations", default=16, show_default=True, help="Calls of each width timed.")
@click.option("--clients", default=1, show_default=True, help="Requests in each call timed.")
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(
    bundle: Path, loads: int, contexts: str, rotations: int, clients: int, out: Path | None
) -> None:
    sizes = [int(n) for n in contexts.split(",")]
    measured = []
    for n in range(loads):
        measured.append(one_load(bundle, sizes, rotations, clients))
        click.echo(f"load {n + 1}: {measured[-1]}", err=True)
    result = {
        "kind": "calibration_error",
        "command": f"python benchmarks/calibration_error.py {bundle.name} --loads {loads} "
        f"--contexts {contexts} --rotations {rotations} --clients {clients}",
        "machine": machine.describe(),
        "loads": loads,
        "clients": clients,
        "rotations": rotations,
        "summary": summary(measured, sizes),
        "measured": measured,  # json writes the contexts and widths as strings
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
