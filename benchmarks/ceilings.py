"""The most a batch can get from speculation on this machine, priced from its own cost curves.

Loads a bundle with as many slots as the largest batch, which measures the verify call by rows
and the draft step by batch size as the runtime does at load. Then, for each batch size B and
per-token acceptance α, it prices every K the way the adaptive controller does: B·E(α, K)
tokens a round over c_draft(K, B) + c_verify(B·(K+1)). Prefill and draft catch-ups are left
out and every round is full, so each figure is an upper bound. Set it beside what a goal asks
before tuning anything: on 2 float32 cores no policy can beat the best row here.

    python benchmarks/ceilings.py BUNDLE --batch 1,4,8 --alpha 0.7,0.8,0.9 [--out F.md]
"""

from __future__ import annotations

from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import StepCosts
from specrt.runtime.pricing import price_round
from specrt.tools.bench import row_padding
from specrt.tools.report import padding_lines


def best_round(costs: StepCosts, batch: int, alpha: float, k_max: int) -> tuple[float, int]:
    """(tokens per second, K) of the best full round of `batch` requests at acceptance alpha,
    each K priced by the controller's own `price_round` with no draft cache behind."""
    fresh = [(0, None)] * batch  # (lag, remaining): no catch-up to price
    options = []
    for k in range(k_max + 1):
        rate, _, _ = price_round([k] * batch, [alpha] * batch, ["model"] * batch, fresh, (), costs)
        options.append((rate, k))
    return max(options)


def table(costs: StepCosts, batches: list[int], alphas: list[float], k_max: int) -> list[str]:
    lines = [
        "| batch | target alone, tok/s | "
        + " | ".join(f"α = {a}: best tok/s (K, × alone)" for a in alphas)
        + " |",
        "|---" * (len(alphas) + 2) + "|",
    ]
    for batch in batches:
        alone = batch / costs.verify_cost(batch)
        cells = []
        for alpha in alphas:
            rate, k = best_round(costs, batch, alpha, k_max)
            cells.append(f"{rate:.1f} (K {k}, {rate / alone:.2f}×)")
        lines.append(f"| {batch} | {alone:.1f} | " + " | ".join(cells) + " |")
    return lines


def report(rt: SpeculativeRuntime, command: str, sizes: list[int], rates: list[float]) -> dict:
    """The result as recorded: the machine, the target's row padding, the curves, the table."""
    costs = rt.costs
    return {
        "kind": "ceilings",
        "bundle": rt.bundle.precision_label,
        "command": command,
        "machine": machine.describe(None),
        "row_padding": row_padding(rt),
        "verify_ms_by_rows": {n: 1000 * s for n, s in costs.curve().items()},
        "draft_ms_by_rows": {n: 1000 * s for n, s in sorted(costs.draft.items())},
        "table": table(costs, sizes, rates, rt.bundle.max_draft),
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    curve = ", ".join(f"{n}: {ms:.0f}" for n, ms in result["verify_ms_by_rows"].items())
    steps = ", ".join(f"{n}: {ms:.1f}" for n, ms in result["draft_ms_by_rows"].items())
    lines = [
        f"# Upper bounds from measured costs: {result['bundle']}",
        "",
        f"{machine.label(m)}; {m['date']}. `{result['command']}`. No prefill, no catch-ups, "
        "every round full.",
        "",
        *result["table"],
        "",
        f"Verify call, ms by rows: {curve}.",
        "",
        f"Draft step, ms by rows: {steps}.",
        *padding_lines({result["bundle"]: result["row_padding"]}),
    ]
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--batch", "batches", default="1,4,8", show_default=True)
@click.option("--alpha", "alphas", default="0.7,0.8,0.9", show_default=True)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Also write the Markdown here, and JSON beside."
)
def main(bundle: Path, batches: str, alphas: str, out: Path | None) -> None:
    sizes = [int(b) for b in batches.split(",")]
    rates = [float(a) for a in alphas.split(",")]
    rt = SpeculativeRuntime.load(bundle, slots=max(sizes))
    if rt.draft is None:
        raise click.UsageError(f"{bundle} has no draft model: nothing to price drafts by")
    command = f"python benchmarks/ceilings.py {bundle.name} --batch {batches} --alpha {alphas}"
    result = report(rt, command, sizes, rates)
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
