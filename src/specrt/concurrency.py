"""`specrt bench --concurrency 1,2,4,8,16`: throughput and latency as clients share the engines.

Each level keeps `concurrency` requests in flight (a closed loop: a client sends its next request
as soon as its last one ends) through the same `Scheduler` the server runs, in process, so the
figures are the batched runtime's own, not HTTP's. A level serves 2 x concurrency requests (at
least 4), cycling through the prompts, greedy, each generating exactly max_new_tokens. Every
output is compared with the same prompt run alone (a batch of one, adaptive speculation, whose
output the test suite holds equal to the target alone): `identical_to_alone`.

Configurations: the target alone (batched, K = 0), fixed K = 1, 2, 4, and adaptive; names carry
the bundle's precision label as `specrt bench` rows do.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specrt import machine
from specrt.bench import current_rss_mb, fmt, padding_lines, row_padding, write_report
from specrt.errors import SpecrtError
from specrt.runtime import Generation, Scheduler, SpeculativeRuntime

Log = Callable[[str], None]
CONFIGS = {
    "target_only": {"speculate": False},
    "fixed_1": {"controller": "fixed:1"},
    "fixed_2": {"controller": "fixed:2"},
    "fixed_4": {"controller": "fixed:4"},
    "adaptive": {"controller": "adaptive"},
}


def bench_concurrency(
    bundles, prompts, levels: str, max_new_tokens, repeat, only, threads, out, stem, log: Log
) -> str:
    """The CLI's `--concurrency 1,2,4`: run, write JSON/Markdown/PNG, return the Markdown."""
    try:
        counts = sorted({int(n) for n in levels.split(",")})
    except ValueError:
        raise SpecrtError(f"--concurrency takes numbers like 1,2,4, got {levels!r}") from None
    if counts[0] < 1:
        raise SpecrtError(f"--concurrency levels must be >= 1, got {levels!r}")
    result = run_concurrency(
        bundles,
        prompts,
        counts,
        max_new_tokens=max_new_tokens,
        repeat=repeat,
        only=only,
        threads=threads,
        log=log,
    )
    for path in write_report(result, out, stem, log=log, render=markdown, draw=chart):
        log(f"wrote {path}")
    return markdown(result)


def run_level(
    rt: SpeculativeRuntime,
    prompts: list[list[int]],
    options: dict,
    concurrency: int,
    max_new_tokens: int,
    alone: dict[int, list[int]],
) -> dict:
    """Serve one level; return its figures."""
    scheduler = Scheduler(rt.target, rt.costs, concurrency)
    count = max(4, 2 * concurrency)
    todo = deque((i % len(prompts)) for i in range(count))
    sent: dict[Generation, tuple[int, float]] = {}
    first: dict[Generation, float] = {}
    done: list[tuple[Generation, float]] = []
    start = time.perf_counter()
    while todo or scheduler.running or scheduler.waiting:
        while todo and scheduler.has_room:
            index = todo.popleft()
            generation = rt.stream(
                prompts[index], max_new_tokens=max_new_tokens, ignore_eos=True, **options
            )
            scheduler.add(generation)
            sent[generation] = (index, time.perf_counter())
        step = scheduler.step()
        now = time.perf_counter()
        for generation in step.moved:
            if generation.stops.tokens:
                first.setdefault(generation, now)
            if generation.result is not None:
                done.append((generation, now))
    seconds = time.perf_counter() - start
    return _figures(done, sent, first, alone, seconds)


def _figures(done, sent, first, alone, seconds: float) -> dict:
    tokens = sum(len(g.result.token_ids) for g, _ in done)
    per_request = [len(g.result.token_ids) / (end - sent[g][1]) for g, end in done]
    ttft = [first[g] - sent[g][1] for g, _ in done]
    latencies = [x for g, _ in done for x in g.result.stats.token_latencies()]
    ks = [k for g, _ in done for k in g.result.stats.ks]
    same = [g.result.token_ids == alone[sent[g][0]] for g, _ in done]
    return {
        "requests": len(done),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "aggregate_tokens_per_s": tokens / seconds,
        "per_request_tokens_per_s": float(np.mean(per_request)),
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
        "per_token_p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "per_token_p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "mean_k": float(np.mean(ks)) if ks else 0.0,
        "identical_to_alone": all(same),
        "mismatches": same.count(False),
    }


def run_concurrency(
    bundle_paths: Sequence[Path],
    prompts: list[dict],
    levels: Sequence[int],
    *,
    max_new_tokens: int = 64,
    repeat: int = 1,
    only: Sequence[str] | None = None,
    threads: int | None = None,
    log: Log = print,
) -> dict:
    """Every configuration at every level, for every bundle, side by side in one run. With
    repeat, each level runs every configuration in turn, `repeat` times over, so that a slow
    spell of a shared machine falls on all of them; a level reports the median run."""
    entries, costs, padding = [], {}, {}
    for path in bundle_paths:
        log(f"loading {path} with {max(levels)} slots (and calibrating the batch cost curves)")
        rt = SpeculativeRuntime.load(path, slots=max(levels), threads=threads)
        label = rt.bundle.precision_label
        costs[label] = {str(n): round(1000 * s, 1) for n, s in rt.costs.curve().items()}
        padding[label] = row_padding(rt)
        ids = [rt.encode(p.get("messages") or p["prompt"]) for p in prompts]
        alone = {
            i: rt.generate(p, max_new_tokens=max_new_tokens, ignore_eos=True).token_ids
            for i, p in enumerate(ids)
        }
        configs = {
            f"{config}_{label}": (config, options)
            for config, options in CONFIGS.items()
            if not only or config in only or f"{config}_{label}" in only
        }
        runs: dict[tuple[str, int], list[dict]] = {}
        for level in levels:
            for _ in range(repeat):
                for name, (_, options) in configs.items():
                    figures = run_level(rt, ids, options, level, max_new_tokens, alone)
                    runs.setdefault((name, level), []).append(figures)
                    log(
                        f"  {name} x{level}: {figures['aggregate_tokens_per_s']:.1f} tok/s, "
                        f"mean K {figures['mean_k']:.2f}, "
                        f"identical {figures['identical_to_alone']}"
                    )
        for name, (config, _) in configs.items():
            for level in levels:
                entry = {"name": name, "config": config, "bundle": label, "concurrency": level}
                entries.append({**entry, **_median(runs[name, level]), "rss_mb": current_rss_mb()})
        del rt
    return {
        "kind": "concurrency",
        "machine": machine.describe(threads),
        "settings": {
            "bundles": [str(p) for p in bundle_paths],
            "levels": list(levels),
            "repeat": repeat,
            "prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "greedy": True,
        },
        "configs": entries,
        "verify_ms_by_rows": costs,
        "row_padding": padding,
        "goals": goals(entries),
    }


def _median(runs: list[dict]) -> dict:
    """The run of median aggregate throughput, with the counts and checks of all runs."""
    ordered = sorted(runs, key=lambda run: run["aggregate_tokens_per_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["aggregate_runs"] = [run["aggregate_tokens_per_s"] for run in runs]
    median["identical_to_alone"] = all(run["identical_to_alone"] for run in runs)
    median["mismatches"] = sum(run["mismatches"] for run in runs)
    return median


def _level(entries: list[dict], name: str, level: int) -> dict | None:
    return next((e for e in entries if e["name"] == name and e["concurrency"] == level), None)


def goals(entries: list[dict]) -> list[dict]:
    """The issue's goals, per bundle and level, as measured ratios."""
    out = []
    for label in dict.fromkeys(e["bundle"] for e in entries):
        single = _level(entries, f"adaptive_{label}", 1)
        for level in sorted({e["concurrency"] for e in entries if e["bundle"] == label}):
            here = [e for e in entries if e["bundle"] == label and e["concurrency"] == level]
            adaptive = _level(entries, f"adaptive_{label}", level)
            target = _level(entries, f"target_only_{label}", level)
            if adaptive is None:
                continue
            best = max(here, key=lambda e: e["aggregate_tokens_per_s"])
            rate = adaptive["aggregate_tokens_per_s"]
            out.append(
                {
                    "bundle": label,
                    "concurrency": level,
                    "adaptive_vs_single_stream": rate / single["aggregate_tokens_per_s"]
                    if single
                    else None,
                    "adaptive_vs_target_alone": rate / target["aggregate_tokens_per_s"]
                    if target
                    else None,
                    "adaptive_vs_best": rate / best["aggregate_tokens_per_s"],
                    "best": best["name"],
                    "adaptive_mean_k": adaptive["mean_k"],
                }
            )
    return out


def markdown(result: dict) -> str:
    m, s, entries = result["machine"], result["settings"], result["configs"]
    levels = s["levels"]
    lines = [
        "# specrt bench --concurrency",
        "",
        f"{machine.label(m)}, {m['memory_gib']} GiB; {m['date']}; {s['prompts']} "
        f"prompts cycled, {s['max_new_tokens']} new tokens each, greedy; closed loop, "
        "2 x concurrency requests (at least 4) per level; the median of "
        f"{s.get('repeat', 1)} run(s) of each level.",
        "",
        "Aggregate tokens/s (mean K chosen; = alone: every output equals the request run alone):",
        "",
        "| configuration | " + " | ".join(f"x{n}" for n in levels) + " | = alone |",
        "|---|" + "---|" * (len(levels) + 1),
    ]
    for name in dict.fromkeys(e["name"] for e in entries):
        cells = []
        for level in levels:
            e = _level(entries, name, level)
            cells.append(
                "–" if e is None else f"{e['aggregate_tokens_per_s']:.1f} (K {e['mean_k']:.1f})"
            )
        same = all(e["identical_to_alone"] for e in entries if e["name"] == name)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    lines += [
        "",
        "Latency per request (TTFT p50 ms / per-token p50 ms / p99 ms / request tokens/s):",
        "",
        "| configuration | " + " | ".join(f"x{n}" for n in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for name in dict.fromkeys(e["name"] for e in entries):
        cells = []
        for level in levels:
            e = _level(entries, name, level)
            cells.append(
                "–"
                if e is None
                else f"{e['ttft_p50_ms']:.0f} / {e['per_token_p50_ms']:.0f} / "
                f"{e['per_token_p99_ms']:.0f} / {e['per_request_tokens_per_s']:.1f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Goals (adaptive's aggregate tokens/s against single-stream adaptive, the batched "
        "target alone, and the best configuration at that concurrency):",
        "",
        "| bundle | concurrency | vs single stream | vs target alone | vs best | best | mean K |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in result["goals"]:
        lines.append(
            f"| {g['bundle']} | {g['concurrency']} | "
            f"{fmt(g['adaptive_vs_single_stream'], '.2f')}× | "
            f"{fmt(g['adaptive_vs_target_alone'], '.2f')}× | {g['adaptive_vs_best']:.2f}× | "
            f"{g['best']} | {g['adaptive_mean_k']:.2f} |"
        )
    lines += [*padding_lines(result.get("row_padding", {})), ""]
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["configs"]
    bundles = list(dict.fromkeys(e["bundle"] for e in entries))
    fig, axes = plt.subplots(1, len(bundles), figsize=(7 * len(bundles), 5), squeeze=False)
    for axis, label in zip(axes[0], bundles, strict=True):
        for config in CONFIGS:
            points = sorted(
                (e["concurrency"], e["aggregate_tokens_per_s"])
                for e in entries
                if e["bundle"] == label and e["config"] == config
            )
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, "o-", label=config)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel("aggregate tokens/s")
        axis.set_title(label)
        axis.legend(fontsize=8)
    fig.suptitle("specrt: throughput against concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
