"""The draft window on Spec-Bench's long-input prompts: the draft model reading the whole prompt
against reading its window (`--draft-window`), adaptive, greedy, answers as long as the model
makes them (up to --max-new-tokens).

The prompts are the first turns of the categories' questions longer than --min-tokens (as chat
messages). Per prompt, in one process: the target's prefill is paid once and reused from its
slot; each run starts from the costs calibrated at load and a fresh acceptance pool, so one
run's rounds do not set the next one's course. Decode: tokens after the first over their
seconds, the draft model's catch-up included. `--warm` adds, per window, a run from the costs
as one long prompt (the first picked, answered once beforehand) left them, as a server's are
after its first: calibration measures draft calls of up to 33 tokens, and the rounds then
measure the catch-ups of a window's size.

    python benchmarks/draft_window.py BUNDLE [--questions ../shared/specbench/question.jsonl] \
        [--categories summarization,rag] [--per-category 3]
        [--windows 0,512] [--warm] [--out benchmarks/results/cpu-draft-window]
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result
from specrt.tools.prompts import load_prompts

WARM = "warm"  # a column from the costs one long prompt refined


def prompts(
    rt, questions_file: Path, categories: list[str], per_category: int, min_tokens: int
) -> list[dict]:
    """The first `per_category` first turns of each category longer than `min_tokens` as a
    chat prompt, each with its length (`prompt_tokens`)."""
    loaded = load_prompts([questions_file], categories)
    for item in loaded:
        item["prompt_tokens"] = len(rt.encode(item["messages"]))
    picked = []
    for category in categories:
        long = [i for i in loaded if i["category"] == category and i["prompt_tokens"] > min_tokens]
        picked += long[:per_category]
    return picked


def measure(bundle: Path, picked_by, windows: list[int], max_new: int, warm: bool) -> list[dict]:
    """Per prompt, a run per column (`columns`), each from its costs and a fresh pool."""
    from specrt.runtime import SpeculativeRuntime
    from specrt.runtime.drafters import make_drafter
    from specrt.runtime.pool import PooledAcceptance

    rt = SpeculativeRuntime.load(bundle)
    starts = {"": copy.deepcopy(rt.costs)}
    picked = picked_by(rt)
    if warm:
        rt.generate(picked[0]["messages"], max_new_tokens=max_new)
        starts[WARM] = copy.deepcopy(rt.costs)
    rows = []
    for item in picked:
        row = {"category": item["category"], "prompt_tokens": item["prompt_tokens"]}
        for column in columns(windows, warm):
            window, _, start = column.partition(" ")
            rt.costs, rt.acceptance = copy.deepcopy(starts[start]), PooledAcceptance()
            drafter = make_drafter("model", rt.draft, window=int(window) or None)
            result = rt.generate(item["messages"], max_new_tokens=max_new, drafter=drafter)
            s = result.stats
            row[column] = {
                "new_tokens": s.new_tokens,
                "decode_seconds": round(s.total_seconds - s.ttft_seconds, 3),
                "mean_k": round(sum(s.ks) / max(1, len(s.ks)), 2),
                "accepted": s.accepted,
                "drafted": s.drafted,
                "tokens": result.token_ids,
            }
        rows.append(row)
        print(json.dumps(row)[:300], flush=True)
    return rows


def columns(windows: list[int], warm: bool) -> list[str]:
    """A run's keys: each window from calibrated costs ("512"), then from warmed ones."""
    return [str(w) for w in windows] + ([f"{w} {WARM}" for w in windows] if warm else [])


def _name(column: str) -> str:
    window, _, start = column.partition(" ")
    name = "whole prompt" if window == "0" else f"window {window}"
    return f"{name}, warmed costs" if start else name


def _rate(run: dict) -> float:
    return (run["new_tokens"] - 1) / run["decode_seconds"]


def markdown(result: dict) -> str:
    windows = result.get("columns") or [str(w) for w in result["windows"]]
    names = [_name(w) for w in windows]
    lines = [
        "# The draft window on Spec-Bench's long-input prompts",
        "",
        "Adaptive, greedy, up to "
        f"{result['max_new_tokens']} new tokens (the model's own length); per cell: decode "
        "tokens/s, mean K, drafts accepted / drafted. Each run from the calibrated costs and a "
        f"fresh acceptance pool, the target's prefill reused. `{result['command']}`",
        "",
        "| category | prompt tokens | new tokens | " + " | ".join(names) + " | same output |",
        "|---" * (len(names) + 4) + "|",
    ]
    totals = {w: [0, 0.0] for w in windows}
    for row in result["rows"]:
        cells = []
        for w in windows:
            run = row[w]
            totals[w][0] += run["new_tokens"] - 1
            totals[w][1] += run["decode_seconds"]
            cells.append(
                f"{_rate(run):.2f}, K {run['mean_k']:.1f}, {run['accepted']}/{run['drafted']}"
            )
        same = all(row[w]["tokens"] == row[windows[0]]["tokens"] for w in windows)
        new = row[windows[0]]["new_tokens"]
        lines.append(
            f"| {row['category']} | {row['prompt_tokens']:,} | {new} | "
            + " | ".join(cells)
            + f" | {'yes' if same else 'NO'} |"
        )
    overall = [f"{tokens / seconds:.2f}" for tokens, seconds in totals.values()]
    lines.append("| all | | | " + " | ".join(overall) + " | |")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--questions",
    type=click.Path(exists=True, path_type=Path),
    default=Path("../shared/specbench/question.jsonl"),
    show_default=True,
    help="Spec-Bench's question.jsonl.",
)
@click.option("--categories", default="summarization,rag", show_default=True)
@click.option("--per-category", default=3, show_default=True)
@click.option("--min-tokens", default=600, show_default=True, help="Longer prompts only.")
@click.option("--windows", default="0,512", show_default=True, help="0: the whole prompt.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--warm", is_flag=True, help="Also from costs one long prompt refined.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-draft-window"))
def main(
    bundle, questions, categories, per_category, min_tokens, windows, max_new_tokens, warm, out
) -> None:
    chosen = categories.split(",")
    lengths = [int(w) for w in windows.split(",")]
    rows = measure(
        bundle,
        lambda rt: prompts(rt, questions, chosen, per_category, min_tokens),
        lengths,
        max_new_tokens,
        warm,
    )
    result = {
        "kind": "draft_window",
        "machine": machine.describe(),
        "command": f"python benchmarks/draft_window.py BUNDLE --categories {categories} "
        f"--per-category {per_category} --min-tokens {min_tokens} --windows {windows} "
        f"--max-new-tokens {max_new_tokens}" + (" --warm" if warm else ""),
        "windows": lengths,
        "columns": columns(lengths, warm),
        "max_new_tokens": max_new_tokens,
        "rows": rows,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
