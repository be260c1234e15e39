"""What the row probe buys at one request: tokens/s with the target's calls padded to even rows
(what every int8/int4/gguf target did before the probe) and as the probe decides, side by side.

Both runtimes are loaded at once and every prompt runs on one, then the other, so a slow spell of
a shared machine falls on both. Where the probe finds no padding is needed the outputs must be
identical token for token (padding changes nothing there but the cost); where it pads, both runs
are the same runtime and the ratio is 1 by construction.

    python benchmarks/row_padding.py BUNDLE [BUNDLE ...] [--max-new-tokens 128] [--prompts 8] \
        [--out benchmarks/results/cpu-row-padding]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from specrt import machine
from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.tools.bench import row_padding
from specrt.tools.prompts import load_prompts
from specrt.tools.report import padding_lines

PROMPTS = [Path("benchmarks/prompts") / f"{name}.jsonl" for name in ("chat", "code")]
CONFIGS = {"target_alone": {"speculate": False}, "adaptive": {}}


def runtime(path: Path, even_rows: bool | None) -> SpeculativeRuntime:
    """The bundle's runtime with the target's padding forced (True) or probed (None); the draft
    as always (unpadded: its numbers only move acceptance)."""
    bundle = Bundle.load(path)
    draft = load_engine(bundle, "draft") if bundle.has_draft else None
    target = load_engine(bundle, "target", even_rows=even_rows)
    rt = SpeculativeRuntime(bundle, draft, target)
    rt.calibrate()
    return rt


def side_by_side(path: Path, prompts: list, max_new_tokens: int, log) -> dict:
    runtimes = {"padded": runtime(path, True), "probed": runtime(path, None)}
    ids = [runtimes["probed"].encode(p.get("messages") or p["prompt"]) for p in prompts]
    figures = {}
    for config, options in CONFIGS.items():
        rates: dict[str, list[float]] = {name: [] for name in runtimes}
        same = 0
        for i, prompt in enumerate(ids):
            tokens = {}
            for name, rt in runtimes.items():
                start = time.perf_counter()
                result = rt.generate(
                    prompt, max_new_tokens=max_new_tokens, ignore_eos=True, **options
                )
                rates[name].append(len(result.token_ids) / (time.perf_counter() - start))
                tokens[name] = result.token_ids
            same += tokens["padded"] == tokens["probed"]
            log(f"{path.name} {config} prompt {i + 1}: " + ", ".join(
                f"{name} {r[-1]:.2f} tok/s" for name, r in rates.items()
            ))  # fmt: skip
        padded, probed = (statistics.mean(rates[n]) for n in ("padded", "probed"))
        figures[config] = {
            "padded_tokens_per_s": padded,
            "probed_tokens_per_s": probed,
            "probed_vs_padded": probed / padded,
            "identical": f"{same}/{len(ids)}",
        }
    return {"row_padding": row_padding(runtimes["probed"]), "configs": figures}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Row padding: padded to even rows vs as probed, one request",
        "",
        f"{machine.label(m)}; {m['date']}; {result['prompts']} prompts × "
        f"{result['max_new_tokens']} new tokens, greedy. `{result['command']}`",
        "",
        "| bundle | configuration | padded tok/s | probed tok/s | probed / padded | identical |",
        "|---|---|---|---|---|---|",
    ]
    for label, entry in result["bundles"].items():
        for config, f in entry["configs"].items():
            lines.append(
                f"| {label} | {config} | {f['padded_tokens_per_s']:.2f} | "
                f"{f['probed_tokens_per_s']:.2f} | {f['probed_vs_padded']:.3f}× | "
                f"{f['identical']} |"
            )
    padding = {label: entry["row_padding"] for label, entry in result["bundles"].items()}
    return "\n".join([*lines, *padding_lines(padding), ""])


@click.command()
@click.argument("bundles", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--prompts", "count", default=8, show_default=True, help="How many prompts.")
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(bundles: tuple[Path, ...], max_new_tokens: int, count: int, out: Path | None) -> None:
    prompts = load_prompts(PROMPTS)
    prompts = prompts[:: max(1, len(prompts) // count)][:count]
    names = " ".join(p.name for p in bundles)
    result = {
        "kind": "row_padding",
        "command": f"python benchmarks/row_padding.py {names} --max-new-tokens {max_new_tokens} "
        f"--prompts {count}",
        "machine": machine.describe(),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "bundles": {
            Bundle.load(path).precision_label: side_by_side(path, prompts, max_new_tokens, print)
            for path in bundles
        },
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
