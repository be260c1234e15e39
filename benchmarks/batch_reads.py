"""A batch's call after long prompts: its rows read where they lie against copied out first.

The CPU graph reads a batch's rows through their row views, each row's cache where it lies
(exporter/attention.py); without them (a bundle built before them, or a wider batch) a Loop
copies each row's positions out of the cache first, in every layer. This times the target's
call of B requests of 1 and 2 tokens each after N tokens each, both ways in turn on the same
engine (the views switched off for the copied calls), beside one request's call of 1 token,
and checks that both ways give the same logits bit for bit. With --before, a bundle built
before the views (its batch always copied) is timed beside: what the new graph costs a lone
request, if anything.

The slots hold placeholder keys and values (costs.py's `fill_slots`): a call's time depends on
how many positions it reads, not on what they hold.

    python benchmarks/batch_reads.py BUNDLE [--sizes 1000,4000,8000] [--requests 4] \
        [--passes 12] [--before OLD_BUNDLE] [--out benchmarks/results/cpu-batch-reads]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.bundle import Bundle
from specrt.engines.onnxruntime import OrtEngine
from specrt.files import write_result
from specrt.runtime.costs import fill_slots, time_call

CALLS = ("lone 1", "in place 1", "copied 1", "in place 2", "copied 2")
BEFORE = ("before: lone 1", "before: copied 1")  # a bundle built before the views, beside


def _timed(engines: dict, context: int, requests: int, name: str) -> float:
    """One call of CALLS or BEFORE: `lone W` one request's, `in place W` / `copied W` the
    batch's."""
    engine = engines["before" if name.startswith("before") else "now"]
    way, width = name.removeprefix("before: ").rsplit(" ", 1)
    engine.read_rows_in_place(way != "copied")
    return time_call(engine, context, 1 if way == "lone" else requests, int(width))


def same_logits(engine: OrtEngine, context: int, requests: int) -> bool:
    """Whether the batch's 2-token call gives the same logits read in place and copied."""
    got = []
    for in_place in (True, False):
        engine.read_rows_in_place(in_place)
        for slot in range(requests):
            engine.rollback(context, slot)
        got.append(engine.forward_rows([(slot, [7, 11 + slot]) for slot in range(requests)]))
    engine.read_rows_in_place(True)
    return all(np.array_equal(a, b) for a, b in zip(*got, strict=True))


def measure(
    bundle: Path, sizes: list[int], requests: int, passes: int, before: Path | None
) -> list[dict]:
    engines = {"now": OrtEngine.from_bundle(Bundle.load(bundle), "target", slots=requests)}
    calls = CALLS
    if before is not None:
        engines["before"] = OrtEngine.from_bundle(Bundle.load(before), "target", slots=requests)
        calls += BEFORE
    rows = []
    for context in sizes:
        for engine in engines.values():
            fill_slots(engine, requests, context)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(passes):  # every call in each pass: one moment of the machine for all
            for name in calls:
                times[name].append(_timed(engines, context, requests, name))
        row = {name: round(1000 * statistics.median(t), 1) for name, t in times.items()}
        row |= {"context": context, "identical": same_logits(engines["now"], context, requests)}
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(result: dict) -> str:
    b, before = result["requests"], "before: lone 1" in result["rows"][0]
    lines = [
        "# A batch's call after long prompts: read in place against copied",
        "",
        f"{machine.label(result['machine'])}; {result['machine']['date']}. "
        f"The target's call of {b} requests of W tokens each after N tokens each, its rows read "
        "through their views (in place) and copied out first (the Loop, the views switched "
        f"off), beside one request's call of 1 token; the median of {result['passes']} passes, "
        "the calls interleaved in each pass"
        + ("; beside them, a bundle built before the views (its batch copied)" if before else "")
        + f". `{result['command']}`",
        "",
        f"| N | one request, 1 token | {b} x 1: in place | copied | copied / in place "
        f"| {b} x 2: in place | copied | copied / in place | same logits |"
        + (f" before: one request | before: {b} x 1 |" if before else ""),
        "|---" * (9 + 2 * before) + "|",
    ]
    for r in result["rows"]:
        one, two = r["copied 1"] / r["in place 1"], r["copied 2"] / r["in place 2"]
        lines.append(
            f"| {r['context']:,} | {r['lone 1']} ms | {r['in place 1']} ms | {r['copied 1']} ms "
            f"| {one:.2f}x | {r['in place 2']} ms | {r['copied 2']} ms | {two:.2f}x "
            f"| {'bit for bit' if r['identical'] else 'no'} |"
            + (f" {r['before: lone 1']} ms | {r['before: copied 1']} ms |" if before else "")
        )
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=Path)
@click.option("--sizes", default="1000,4000,8000", show_default=True, help="Tokens each.")
@click.option("--requests", default=4, show_default=True)
@click.option("--passes", default=12, show_default=True)
@click.option("--before", type=Path, help="A bundle built before the views, timed beside.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-batch-reads"))
def main(
    bundle: Path, sizes: str, requests: int, passes: int, before: Path | None, out: Path
) -> None:
    lengths = [int(n) for n in sizes.split(",")]
    result = {
        "kind": "batch_reads",
        "machine": machine.describe(),
        "command": f"python benchmarks/batch_reads.py BUNDLE --sizes {sizes} "
        f"--requests {requests} --passes {passes}" + (" --before OLD_BUNDLE" if before else ""),
        "requests": requests,
        "passes": passes,
        "rows": measure(bundle, lengths, requests, passes, before),
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
