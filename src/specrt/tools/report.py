"""What a `specrt bench` run reports: each configuration's row (speed, latency, acceptance,
whether its outputs match), the comparisons between rows, and the JSON and Markdown written.

Per-token latency is charged as `per_token_latencies` says: a round's block of tokens shares the
time since the previous block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt import machine
from specrt.files import portable, write_bytes_atomic, write_json_atomic
from specrt.runtime.sequence import per_token_latencies
from specrt.tools.charts import chart
from specrt.tools.runners import Run


@dataclass
class Row:
    name: str
    tokens_per_s: float
    decode_tokens_per_s: float  # after the first token: what a long prompt's prefill hides
    ttft_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    tokens_per_target_call: float | None
    acceptance_rate: float | None
    new_tokens: int
    seconds: float
    speedup_vs_pytorch: float | None = None
    identical_to_baseline: bool | None = None
    mismatches_vs_baseline: int = 0
    identical_to_target_alone: bool | None = None
    exact_against: str | None = None  # the target-alone row this row must reproduce
    first_divergence: list[int | None] = field(default_factory=list)
    rss_mb: float = 0.0  # resident memory after the row, with its engines loaded
    speedup_vs_target_alone: float | None = None  # against its own bundle's target alone
    decode_speedup_vs_target_alone: float | None = None
    categories: dict[str, dict] = field(default_factory=dict)  # per prompt category
    accepted_prediction_tokens: int | None = None  # rows drafting from a prediction
    rejected_prediction_tokens: int | None = None


def summarize(name: str, runs: list[Run]) -> Row:
    new = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    latencies = [x for r in runs for x in per_token_latencies(r.token_times, r.ttft)]
    calls = [r.target_calls for r in runs]
    drafted = [r.drafted for r in runs]
    decode_seconds = seconds - sum(r.ttft for r in runs)
    predicted = [r.prediction for r in runs if r.prediction is not None]
    return Row(
        name=name,
        tokens_per_s=new / seconds,
        decode_tokens_per_s=(new - len(runs)) / decode_seconds if decode_seconds > 0 else 0.0,
        ttft_ms=1000 * float(np.mean([r.ttft for r in runs])),
        latency_p50_ms=1000 * float(np.percentile(latencies, 50)) if latencies else 0.0,
        latency_p99_ms=1000 * float(np.percentile(latencies, 99)) if latencies else 0.0,
        tokens_per_target_call=new / sum(calls) if None not in calls else None,
        acceptance_rate=(
            sum(r.accepted for r in runs) / sum(drafted)
            if None not in drafted and sum(drafted)
            else None
        ),
        new_tokens=new,
        seconds=seconds,
        accepted_prediction_tokens=sum(a for a, _ in predicted) if predicted else None,
        rejected_prediction_tokens=sum(r for _, r in predicted) if predicted else None,
    )


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def by_category(runs: list[Run], categories: list[str], repeat: int) -> dict[str, dict]:
    """Tokens/s and tokens per target call for each category's runs (Spec-Bench's columns)."""
    grouped: dict[str, list[Run]] = {}
    for i, run in enumerate(runs):
        grouped.setdefault(categories[i // repeat], []).append(run)
    out = {}
    for category, group in grouped.items():
        row = summarize(category, group)
        out[category] = {
            "prompts": len(group) // repeat,
            "tokens_per_s": row.tokens_per_s,
            "decode_tokens_per_s": row.decode_tokens_per_s,
            "tokens_per_target_call": row.tokens_per_target_call,
        }
    return out


def compare_rows(rows: list[Row], outputs: dict) -> None:
    base = outputs.get("pytorch_baseline")
    base_speed = next((r.tokens_per_s for r in rows if r.name == "pytorch_baseline"), None)
    for row in rows:
        mine = outputs[row.name]
        if base_speed:
            row.speedup_vs_pytorch = row.tokens_per_s / base_speed
        if base is not None:
            row.first_divergence = [
                _first_divergence(a, b) for a, b in zip(mine, base, strict=True)
            ]
            row.mismatches_vs_baseline = sum(d is not None for d in row.first_divergence)
            row.identical_to_baseline = row.mismatches_vs_baseline == 0
        alone = outputs.get(row.exact_against)
        if alone is not None:
            row.identical_to_target_alone = mine == alone
            _speedups(row, next(r for r in rows if r.name == row.exact_against))


def _speedups(row: Row, alone: Row) -> None:
    """Against the target alone of the same bundle: overall and per category."""
    row.speedup_vs_target_alone = row.tokens_per_s / alone.tokens_per_s
    row.decode_speedup_vs_target_alone = _ratio(row.decode_tokens_per_s, alone.decode_tokens_per_s)
    for category, cell in row.categories.items():
        base = alone.categories[category]
        cell["speedup_vs_target_alone"] = cell["tokens_per_s"] / base["tokens_per_s"]
        cell["decode_speedup_vs_target_alone"] = _ratio(
            cell["decode_tokens_per_s"], base["decode_tokens_per_s"]
        )


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # None: answers of one token have no decoding to compare


def write_report(
    result: dict, out: Path, stem: str, log: Callable[[str], None] = print, render=None, draw=None
) -> list[Path]:
    """JSON, a Markdown table and a PNG chart (without matplotlib, the bench extra, the chart
    is skipped with a line saying so); returns the paths written. render and draw make the
    table and the chart (default: this module's, for `specrt bench` results)."""
    render, draw = render or markdown, draw or chart
    result = portable(result)  # paths and commands as any machine types them
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    write_json_atomic(paths[0], result)
    write_bytes_atomic(paths[1], render(result).encode())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("chart skipped: matplotlib is not installed (pip install 'specrt[bench]')")
        return paths
    paths.append(out / f"{stem}.png")
    draw(result, paths[2])
    return paths


def fmt(value, spec: str) -> str:
    """A figure, or a dash where there is none."""
    return "–" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        f"# specrt bench: {Path(result['bundle']).name}",
        "",
        f"{machine.label(m)}, {m['memory_gib']} GiB; {m['date']}; "
        f"{s['prompts']} prompts ({', '.join(s['prompt_sets'])}) × {s['max_new_tokens']} new "
        f"tokens, greedy, repeat {s['repeat']}; bundles {', '.join(_precisions(result))}; "
        f"peak RSS {result.get('peak_rss_mb', 0):.0f} MB.",
        "",
        "| configuration | tokens/s | vs PyTorch | vs target alone | decode tokens/s "
        "| decode vs target alone | TTFT ms | p50 ms/tok | p99 ms/tok | tokens/target call "
        "| acceptance | = baseline | = target alone | RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["configs"]:
        same = fmt(r["identical_to_baseline"], "")
        if r["mismatches_vs_baseline"]:
            same = f"no ({r['mismatches_vs_baseline']} differ)"
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.2f} | {fmt(r['speedup_vs_pytorch'], '.2f')}× "
            f"| {fmt(r.get('speedup_vs_target_alone'), '.2f')}× "
            f"| {fmt(r.get('decode_tokens_per_s'), '.2f')} "
            f"| {fmt(r.get('decode_speedup_vs_target_alone'), '.2f')}× | {r['ttft_ms']:.0f} "
            f"| {r['latency_p50_ms']:.0f} | {r['latency_p99_ms']:.0f} "
            f"| {fmt(r['tokens_per_target_call'], '.2f')} | {fmt(r['acceptance_rate'], '.0%')} "
            f"| {same} | {fmt(r['identical_to_target_alone'], '')} "
            f"| {r.get('rss_mb', 0):.0f} |"
        )
    lines += ["", '"= target alone" compares with the target-alone row of the same bundle.']
    lines += _prediction_lines(result["configs"])
    lines += _category_lines(result["configs"])
    lines += _cost_lines(result.get("costs", {}))
    lines += padding_lines(result.get("row_padding", {}))
    lines += _quality_lines(result.get("quality", {}))
    lines += ["", *[f"- {note}" for note in result["notes"]], ""]
    return "\n".join(lines)


def _prediction_lines(rows: list[dict]) -> list[str]:
    """Prediction tokens the outputs kept and dropped, for the rows that sent one."""
    predicted = [r for r in rows if r.get("accepted_prediction_tokens") is not None]
    if not predicted:
        return []
    lines = ["", "| configuration | prediction tokens accepted | rejected |", "|---|---|---|"]
    for r in predicted:
        accepted, rejected = r["accepted_prediction_tokens"], r["rejected_prediction_tokens"]
        lines.append(f"| {r['name']} | {accepted} | {rejected} |")
    return lines


def _category_lines(rows: list[dict]) -> list[str]:
    """Spec-Bench's view: per category, speedup over the target alone (tokens per target call)."""
    names = sorted({c for r in rows for c in r.get("categories", {})})
    if len(names) < 2:
        return []
    lines = [
        "",
        "Per category: speedup over the same bundle's target alone, end to end / decoding only "
        "(tokens per target call):",
        "",
        "| configuration | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = []
        for name in names:
            cell = r.get("categories", {}).get(name, {})
            speed = fmt(cell.get("speedup_vs_target_alone"), ".2f")
            decode = fmt(cell.get("decode_speedup_vs_target_alone"), ".2f")
            calls = fmt(cell.get("tokens_per_target_call"), ".2f")
            cells.append(f"{speed}× / {decode}× ({calls})")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


def _quality_lines(quality: dict) -> list[str]:
    """Each bundle's roles against float32, as their builds measured it on the prose sample."""
    lines = [
        "",
        "Quality against float32 (the build's check on the package's prose sample; "
        "`specrt eval` measures longer texts):",
        "",
        "| bundle | role | precision | KL mean | top-1 agreement |",
        "|---|---|---|---|---|",
    ]
    for label, roles in quality.items():
        for role, q in roles.items():
            lines.append(
                f"| {label} | {role} | {q['precision']} "
                f"| {fmt(q.get('kl_mean_vs_float32'), '.4f')} "
                f"| {fmt(q.get('top1_agreement_vs_float32'), '.1%')} |"
            )
    return lines if quality else []


def _precisions(result: dict) -> list[str]:
    return result["settings"].get("precisions") or [result["settings"].get("dtype", "float32")]


def _cost_lines(costs: dict) -> list[str]:
    """Verify cost c_verify(K)/c_verify(0) per bundle: what the adaptive policy trades against."""
    if not costs:
        return []
    counts = sorted({int(n) for c in costs.values() for n in c["verify_ms"]})
    lines = [
        "",
        "Verify cost after a 48-token prefix, relative to one new token (K drafts = K+1 tokens):",
        "",
        "| bundle | draft step ms | 1 token ms | " + " | ".join(f"{n}" for n in counts) + " |",
        "|---|---|---|" + "---|" * len(counts),
    ]
    for label, c in costs.items():
        ratios = {int(n): v for n, v in c["verify_ratio"].items()}
        cells = " | ".join(fmt(ratios.get(n), ".2f") for n in counts)
        one = c["verify_ms"].get("1", c["verify_ms"].get(1))
        lines.append(f"| {label} | {fmt(c['draft_step_ms'], '.1f')} | {one:.1f} | {cells} |")
    return lines


def padding_lines(padding: dict) -> list[str]:
    """Per bundle, whether the target's calls were padded to even rows on this machine."""
    found = [f"- {label}: {p['finding']}" for label, p in padding.items() if p]
    return ["", "Target rows (probed at load):", "", *found] if found else []
