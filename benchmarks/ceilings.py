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

from specrt.bench import machine_info
from specrt.files import write_bytes_atomic
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.controller import price_round
from specrt.runtime.costs import StepCosts


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


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--batch", "batches", default="1,4,8", show_default=True)
@click.option("--alpha", "alphas", default="0.7,0.8,0.9", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), help="Also write the Markdown here.")
def main(bundle: Path, batches: str, alphas: str, out: Path | None) -> None:
    sizes = [int(b) for b in batches.split(",")]
    rates = [float(a) for a in alphas.split(",")]
    rt = SpeculativeRuntime.load(bundle, slots=max(sizes))
    if rt.draft is None:
        raise click.UsageError(f"{bundle} has no draft model: nothing to price drafts by")
    costs, m = rt.costs, machine_info(None)
    curve = ", ".join(f"{n}: {1000 * s:.0f}" for n, s in costs.curve().items())
    steps = ", ".join(f"{n}: {1000 * s:.1f}" for n, s in sorted(costs.draft.items()))
    lines = [
        f"# Upper bounds from measured costs: {rt.bundle.precision_label}",
        "",
        f"{m['cpu']}, {m['cores']} cores; {m['date']}. `python benchmarks/ceilings.py {bundle.name}"
        f" --batch {batches} --alpha {alphas}`. No prefill, no catch-ups, every round full.",
        "",
        *table(costs, sizes, rates, rt.bundle.max_draft),
        "",
        f"Verify call, ms by rows: {curve}.",
        "",
        f"Draft step, ms by rows: {steps}.",
    ]
    text = "\n".join(lines) + "\n"
    click.echo(text)
    if out:
        write_bytes_atomic(out, text.encode())


if __name__ == "__main__":
    main()
