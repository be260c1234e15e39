"""`specrt bench --concurrency 1,2,4,8,16`: throughput and latency as clients share the engines.

Each level keeps `concurrency` requests in flight (a closed loop: a client sends its next request
as soon as its last one ends) through the same `Scheduler` the server runs, in process, so the
figures are the batched runtime's own, not HTTP's. A level serves 2 x concurrency requests (at
least 4), cycling through the prompts, greedy, each generating exactly max_new_tokens. Every
output is compared with the same prompt run alone (a batch of one, adaptive speculation, whose
output the test suite holds equal to the target alone): `identical_to_alone`.

Configurations: the target alone (batched, K = 0), fixed K = 1, 2, 4, and adaptive; names carry
the bundle's precision label as `specrt bench` rows do. Where the first bundle was built from GGUF
files still on disk and a llama-server is found (see llamacpp.py), llama.cpp serves the same
levels on those files, alone and with its draft model: `concurrency` client threads over HTTP,
its own slots (as many as the highest level), the same token ids. Each of its outputs is compared
with its own output for that prompt at one client, so a change with load shows as it does for
specrt's; `matches_specrt` counts how many of its one-client outputs equal specrt's.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from specrt import machine
from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeRuntime
from specrt.tools import llamacpp, verdict
from specrt.tools.bench import current_rss_mb, row_padding
from specrt.tools.load import llama_level, run_level
from specrt.tools.prompts import prompt_input
from specrt.tools.report import fmt, padding_lines, write_report

Log = Callable[[str], None]
LLAMA = "llama.cpp"  # the bundle label of llama-server's rows
CONFIGS = {
    "target_only": {"speculate": False},
    "fixed_1": {"controller": "fixed:1"},
    "fixed_2": {"controller": "fixed:2"},
    "fixed_4": {"controller": "fixed:4"},
    "adaptive": {"controller": "adaptive"},
}


def bench_concurrency(
    bundles,
    prompts,
    levels: str,
    max_new_tokens,
    repeat,
    only,
    threads,
    out,
    stem,
    log: Log,
    llama_cpp=None,
    llama_drafts: tuple[int, ...] | None = None,
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
        llama_cpp=llama_cpp,
        llama_drafts=llama_drafts,
        log=log,
    )
    for path in write_report(result, out, stem, log=log, render=markdown, draw=chart):
        log(f"wrote {path}")
    return markdown(result)


def run_concurrency(
    bundle_paths: Sequence[Path],
    prompts: list[dict],
    levels: Sequence[int],
    *,
    max_new_tokens: int = 64,
    repeat: int = 1,
    only: Sequence[str] | None = None,
    threads: int | None = None,
    llama_cpp: str | Path | None = None,
    llama_drafts: tuple[int, ...] | None = None,
    log: Log = print,
) -> dict:
    """Every configuration at every level, for every bundle, side by side in one run. With
    repeat, each level runs every configuration in turn, `repeat` times over, so that a slow
    spell of a shared machine falls on all of them; a level reports the median run. llama.cpp's
    rows (`llama_cpp`: where llama-server is) follow, on the first bundle's GGUF files, with its
    draft model at each of `llama_drafts` (default: the bundle's K_max) drafted tokens."""
    entries, costs, padding, first = [], {}, {}, None
    for path in bundle_paths:
        rt = _load(path, levels, threads, log)
        calibrated = copy.deepcopy(rt.costs)
        label = rt.bundle.precision_label
        costs[label] = {str(n): round(1000 * s, 1) for n, s in rt.costs.curve().items()}
        padding[label] = row_padding(rt)
        ids = [rt.encode(prompt_input(p)) for p in prompts]
        alone = {
            i: rt.generate(p, max_new_tokens=max_new_tokens, ignore_eos=True).token_ids
            for i, p in enumerate(ids)
        }
        first = first or (rt.bundle, ids, alone)
        rt.costs = calibrated
        entries += _bundle_entries(rt, ids, alone, levels, max_new_tokens, repeat, only, log)
        del rt
    notes = []
    if first is not None and (not only or any(name.startswith("llamacpp") for name in only)):
        bundle, ids, alone = first
        servers, notes = _llama_servers(bundle, llama_cpp, llama_drafts, threads, max(levels), only)
        for name, spec in servers.items():
            entries += _llama_entries(name, spec, ids, alone, levels, max_new_tokens, repeat, log)
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
        "notes": notes,
    }


def _load(path: Path, levels: Sequence[int], threads, log: Log) -> SpeculativeRuntime:
    log(f"loading {path} with {max(levels)} slots (and calibrating the batch cost curves)")
    return SpeculativeRuntime.load(path, slots=max(levels), threads=threads, prompt_cache=False)


def _bundle_entries(rt, ids, alone, levels, max_new_tokens, repeat, only, log: Log) -> list:
    """One bundle's configurations at every level, each level's configurations in turn
    `repeat` times over; an entry per configuration and level, its median run. Every run
    starts from the costs calibrated at load (rt.costs as given), since the counts a fixed K
    times move the drift the next run prices by: at 8 clients on an AVX2 EPYC, adaptive's
    second turn, after the fixed-K runs, drafted (mean K 0.52, 0.80x the target alone, the best
    there); from the calibrated costs neither turn drafted. The acceptance pool is kept, as a
    server keeps it: what the draft accepts on these prompts is the workload's, not a run's.
    Adaptive's entries keep each run's course (`by_request_runs`, by turn): every request's K
    and drafts kept round by round, and the controller's reasons where K turned, so that where
    it stopped and why can be read from the JSON of a machine no longer at hand (at 4 clients
    on an EPYC it stayed at K = 0 where fixed K = 1 ran 1.11x). The median run's alone missed
    the turn that lost: on a Xeon, 4 clients' worst turn drafted at K 1.59 (0.90x the target
    alone), and the median, at K 0.15, said nothing of it."""
    calibrated = rt.costs
    label = rt.bundle.precision_label
    configs = {
        f"{config}_{label}": (config, options)
        for config, options in CONFIGS.items()
        if not only or config in only or f"{config}_{label}" in only
    }
    runs: dict[tuple[str, int], list[dict]] = {}
    for level in levels:
        for _ in range(repeat):
            for name, (_, options) in configs.items():
                rt.costs = copy.deepcopy(calibrated)
                figures = run_level(rt, ids, options, level, max_new_tokens, alone)
                runs.setdefault((name, level), []).append(figures)
                log(
                    f"  {name} x{level}: {figures['aggregate_tokens_per_s']:.1f} tok/s, "
                    f"mean K {figures['mean_k']:.2f}, "
                    f"identical {figures['identical_to_alone']}"
                )
    entries = []
    for name, (config, _) in configs.items():
        for level in levels:
            entry = {"name": name, "config": config, "bundle": label, "concurrency": level}
            courses = [run.pop("by_request", []) for run in runs[name, level]]
            entry |= {**_median(runs[name, level]), "rss_mb": current_rss_mb()}
            if config == "adaptive":  # only adaptive's rounds have a course worth reading
                entry["by_request_runs"] = courses
            entries.append(entry)
    return entries


def _llama_servers(
    bundle: Bundle, hint, drafts, threads, slots: int, only
) -> tuple[dict[str, llamacpp.ServerSpec], list[str]]:
    """The llama-servers to run on the bundle's GGUF files, by row name, and the notes of
    what was skipped and why."""
    if "target" not in llamacpp.gguf_sources(bundle):
        return {}, ["llama.cpp rows skipped: the first bundle was not built from GGUF on disk"]
    binary = llamacpp.find_server(hint)
    if binary is None:
        return {}, [llamacpp.MISSING]
    specs = llamacpp.server_specs(bundle, binary, drafts, threads, slots)
    wanted = {name: spec for name, spec in specs.items() if not only or name in only}
    return wanted, []


def _llama_entries(
    name: str,
    spec: llamacpp.ServerSpec,
    ids: list[list[int]],
    specrt_alone: dict[int, list[int]],
    levels: Sequence[int],
    max_new_tokens: int,
    repeat: int,
    log: Log,
) -> list[dict]:
    """One llama-server at every level; its outputs at one client first, to compare with."""
    entries = []
    with llamacpp.serving(spec) as base:
        alone = {i: llamacpp.complete(base, p, max_new_tokens)[0] for i, p in enumerate(ids)}
        matches = sum(alone[i] == specrt_alone[i] for i in alone)
        for level in levels:
            runs = [llama_level(base, ids, level, max_new_tokens, alone) for _ in range(repeat)]
            figures = _median(runs)
            log(
                f"  {name} x{level}: {figures['aggregate_tokens_per_s']:.1f} tok/s, "
                f"identical {figures['identical_to_alone']}"
            )
            entries.append(
                {
                    "name": name,
                    "config": "llamacpp_draft" if spec.draft else name,
                    "bundle": LLAMA,
                    "concurrency": level,
                    **figures,
                    "matches_specrt": f"{matches}/{len(alone)}",
                }
            )
    return entries


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
            llama = [e for e in entries if e["bundle"] == LLAMA and e["concurrency"] == level]
            llama_best = max(llama, key=lambda e: e["aggregate_tokens_per_s"], default=None)
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
                    "adaptive_vs_best_by_turn": _by_turn(adaptive, here),
                    "best": best["name"],
                    "adaptive_mean_k": adaptive["mean_k"],
                    "adaptive_vs_llamacpp_best": rate / llama_best["aggregate_tokens_per_s"]
                    if llama_best
                    else None,
                    "llamacpp_best": llama_best["name"] if llama_best else None,
                }
            )
    return out


def _by_turn(adaptive: dict, here: list[dict]) -> list[float]:
    """Adaptive's run in each turn of a level (`--repeat`) against that turn's best run of the
    other configurations (above 1 where adaptive beat them all): paired, so a slow spell that
    falls on a whole turn cancels out. On a shared 2-core machine the same configuration ran
    14.8 and 25.0 tokens/s within the hour, so medians taken across turns can put 10 % between
    configurations that chose the same K."""
    runs = [
        e.get("aggregate_runs", [e["aggregate_tokens_per_s"]]) for e in here if e is not adaptive
    ]
    if not runs or len({len(r) for r in runs}) != 1:
        return []
    mine = adaptive.get("aggregate_runs", [adaptive["aggregate_tokens_per_s"]])
    return [mine[t] / max(r[t] for r in runs) for t in range(len(mine))]


def _turns_cell(ratios: list[float]) -> str:
    if not ratios:
        return "–"
    cells = ", ".join(f"{r:.2f}" for r in ratios)
    return f"{cells} ({statistics.median(ratios):.2f}×)" if len(ratios) > 1 else f"{cells}×"


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
            cells.append(_rate_cell(e))
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
    lines += _goal_lines(result["goals"], entries)
    lines += [*padding_lines(result.get("row_padding", {})), *_llama_lines(result), ""]
    return "\n".join(lines)


def _goal_lines(goals: list[dict], entries: list[dict]) -> list[str]:
    lines = [
        "",
        "Goals (adaptive's aggregate tokens/s against single-stream adaptive, the batched "
        "target alone, and the best configuration at that concurrency; by turn: against the "
        "best run of the other configurations in each turn, and the median of those; verdict: "
        "the 0.97x goal judged on the turns' spread, `specrt verdict`):",
        "",
        "| bundle | concurrency | vs single stream | vs target alone | vs best | by turn | "
        "verdict | best | mean K | vs llama.cpp's best | llama.cpp's best |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in goals:
        lines.append(
            f"| {g['bundle']} | {g['concurrency']} | "
            f"{fmt(g['adaptive_vs_single_stream'], '.2f')}× | "
            f"{fmt(g['adaptive_vs_target_alone'], '.2f')}× | {g['adaptive_vs_best']:.2f}× | "
            f"{_turns_cell(g.get('adaptive_vs_best_by_turn', []))} | "
            f"{verdict.brief(verdict.level_turns(entries, g['bundle'], g['concurrency']))} | "
            f"{g['best']} | {g['adaptive_mean_k']:.2f} | "
            f"{fmt(g.get('adaptive_vs_llamacpp_best'), '.2f')}× | {g.get('llamacpp_best') or '–'} |"
        )
    return lines


def _rate_cell(e: dict | None) -> str:
    if e is None:
        return "–"
    rate = f"{e['aggregate_tokens_per_s']:.1f}"
    return rate if e["bundle"] == LLAMA else f"{rate} (K {e['mean_k']:.1f})"


def _llama_lines(result: dict) -> list[str]:
    """How llama.cpp's outputs compare, and why its rows are missing where they are."""
    llama = [e for e in result["configs"] if e["bundle"] == LLAMA]
    lines = ["", *result.get("notes", [])] if result.get("notes") else []
    for name in dict.fromkeys(e["name"] for e in llama):
        own = [e for e in llama if e["name"] == name]
        changed = sum(e["mismatches"] for e in own)  # over every run of a level
        sent = sum(e["requests"] * len(e.get("aggregate_runs", [0])) for e in own)
        lines.append(
            f"- {name}: {changed} of {sent} outputs changed with "
            f"load (against its own at one client); its one-client outputs equal specrt's "
            f"for {own[0]['matches_specrt']} prompts."
        )
    return [""] + lines if llama else lines


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["configs"]
    bundles = [label for label in dict.fromkeys(e["bundle"] for e in entries) if label != LLAMA]
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
        for name in dict.fromkeys(e["name"] for e in entries if e["bundle"] == LLAMA):
            points = sorted(
                (e["concurrency"], e["aggregate_tokens_per_s"])
                for e in entries
                if e["name"] == name
            )
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, "s--", label=name)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel("aggregate tokens/s")
        axis.set_title(label)
        axis.legend(fontsize=8)
    fig.suptitle("specrt: throughput against concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
