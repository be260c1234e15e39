"""A 7-8B target on this machine: its build, its speed alone beside llama.cpp's on the same GGUF,
and the speed-up speculation would give it, projected from its measured costs.

A synthetic checkpoint (`specrt models synthetic`) has a real model's shapes and block types
but random weights: its speed is real, its text is not, so a draft's acceptance on it means
nothing. The speculative figure is therefore a projection, labelled as one: the controller's
own round price (benchmarks/ceilings.py) over this bundle's measured verify and draft curves, at
the acceptance measured on a real pair (int4 0.5B draft, gguf 1.5B target: 87 %, see
cpu-quant-bench.md).

    python benchmarks/big_target.py BUNDLE [--gguf FILE --llama-bench PATH] [--alpha 0.87] \
        [--build-log TIME_V_OUTPUT ...] [--max-new-tokens 64] [--out benchmarks/results/NAME]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import click
from ceilings import best_round

from specrt import machine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.tools.bench import row_padding
from specrt.tools.report import padding_lines

PROMPTS = ["def quicksort(xs):", "Explain how a CPU cache works.", "The history of Rome"]


def target_alone(rt: SpeculativeRuntime, max_new_tokens: int) -> float:
    """Decode tokens per second of the target alone over PROMPTS (a warm-up first)."""
    rt.generate(PROMPTS[0], max_new_tokens=4, speculate=False)
    tokens, seconds = 0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        result = rt.generate(
            prompt, max_new_tokens=max_new_tokens, ignore_eos=True, speculate=False
        )
        seconds += time.perf_counter() - start
        tokens += len(result.token_ids)
    return tokens / seconds


def llama_bench(binary: Path, gguf: Path, max_new_tokens: int, threads: int) -> dict:
    """llama.cpp's own decode speed on the file: `llama-bench -p 0 -n N` (tg N), 2 repetitions."""
    command = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(max_new_tokens)]
    command += ["-t", str(threads), "-r", "2", "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    row = json.loads(out)[0]
    return {"tokens_per_s": row["avg_ts"], "build": row.get("build_commit"), "command": command}


def build_facts(log: Path) -> dict:
    """Peak RSS and wall time from a `/usr/bin/time -v specrt build ...` output."""
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    command = re.search(r'Command being timed: "(.*)"', text)
    return {
        "peak_rss_gb": int(rss.group(1)) / 1e6 if rss else None,
        "wall": wall.group(1) if wall else None,
        "command": command.group(1) if command else None,
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# A 7-8B target: {result['bundle']}",
        "",
        f"{machine.label(m)}; {m['date']}. `{result['command']}`",
        "",
        "| | tokens/s |",
        "|---|---|",
        f"| specrt, target alone (measured) | {result['target_alone_tokens_per_s']:.2f} |",
    ]
    if result.get("llama_cpp"):
        lines.append(f"| llama.cpp, target alone (llama-bench tg) | "
                     f"{result['llama_cpp']['tokens_per_s']:.2f} |")  # fmt: skip
    for alpha, p in result["projection"].items():
        lines.append(
            f"| specrt speculation, **projected** at acceptance {alpha} (K {p['k']}) | "
            f"{p['tokens_per_s']:.2f} ({p['vs_measured_alone']:.2f}× measured alone, "
            f"{p['vs_target_alone']:.2f}× priced alone) |"
        )
    curve = ", ".join(f"{n}: {ms:.0f}" for n, ms in result["verify_ms_by_rows"].items())
    steps = ", ".join(f"{n}: {ms:.1f}" for n, ms in result["draft_ms_by_rows"].items())
    lines += ["", f"Verify call, ms by rows: {curve}.", "", f"Draft step, ms by rows: {steps}."]
    for label, facts in result["builds"].items():
        lines.append("")
        lines.append(f"Build {label}: peak RSS {facts['peak_rss_gb']:.2f} GB, wall {facts['wall']} "
                     f"(`{facts['command']}`).")  # fmt: skip
    lines += padding_lines({result["bundle"]: result["row_padding"]})
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--gguf", type=click.Path(exists=True, path_type=Path), help="The target's GGUF.")
@click.option("--llama-bench", "binary", type=click.Path(exists=True, path_type=Path))
@click.option("--alpha", "alphas", default="0.8,0.87,0.9", show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--build-log", "logs", multiple=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Write OUT.json and OUT.md.")
def main(bundle, gguf, binary, alphas, max_new_tokens, logs, out) -> None:
    rt = SpeculativeRuntime.load(bundle, prompt_cache=False)
    if rt.draft is None:
        raise click.UsageError(f"{bundle} has no draft model: nothing to project speculation by")
    alone = target_alone(rt, max_new_tokens)
    projection = {}
    for alpha in (float(a) for a in alphas.split(",")):
        rate, k = best_round(rt.costs, 1, alpha, rt.bundle.max_draft)
        projection[str(alpha)] = {
            "tokens_per_s": rate,
            "k": k,
            "vs_target_alone": rate * rt.costs.verify_cost(1),  # both priced from the curve
            "vs_measured_alone": rate / alone,
        }
    result = {
        "kind": "big_target",
        "bundle": rt.bundle.precision_label,
        "command": f"python benchmarks/big_target.py {bundle.name} --alpha {alphas} "
        f"--max-new-tokens {max_new_tokens}"
        + (f" --gguf {gguf.name} --llama-bench {binary.name}" if binary and gguf else ""),
        "machine": machine.describe(None),
        "row_padding": row_padding(rt),
        "target_alone_tokens_per_s": alone,
        "projection": projection,
        "projection_basis": "the controller's round price over this bundle's measured curves "
        "(benchmarks/ceilings.py), batch 1, every round full, no prefill",
        "verify_ms_by_rows": {n: 1000 * s for n, s in rt.costs.curve().items()},
        "draft_ms_by_rows": {n: 1000 * s for n, s in sorted(rt.costs.draft.items())},
        "llama_cpp": llama_bench(binary, gguf, max_new_tokens, os.cpu_count() or 1)
        if binary and gguf
        else None,
        "builds": {log.stem: build_facts(log) for log in logs},
    }
    click.echo(text := markdown(result))
    write_result(out, result, text)


if __name__ == "__main__":
    main()
