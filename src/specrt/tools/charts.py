"""The chart of a `specrt bench` run (matplotlib, the bench extra): speed by configuration,
by fixed K or category, and the verify cost curve."""

from __future__ import annotations

import re
from pathlib import Path


def _fixed_rows(rows: list[dict]) -> dict[str, dict[int, dict]]:
    """specrt_fixed_K[_label] rows grouped by label, then by K."""
    grouped: dict[str, dict[int, dict]] = {}
    for row in rows:
        match = re.fullmatch(r"specrt_fixed_(\d+)(_.+)?", row["name"])
        if match:
            label = (match.group(2) or "_d-fp32_t-fp32")[1:]
            grouped.setdefault(label, {})[int(match.group(1))] = row
    return grouped


def _chart_fixed(axes, rows: list[dict]) -> None:
    for suffix, fixed in _fixed_rows(rows).items():
        ks = sorted(fixed)
        axes.plot(ks, [fixed[k]["tokens_per_target_call"] for k in ks], "o-", label=suffix)
    axes.set_xlabel("K (fixed)")
    axes.set_ylabel("tokens per target call")
    axes.set_title("tokens per target call vs K")
    if axes.lines:
        axes.legend(fontsize=8)


def _chart_categories(axes, rows: list[dict]) -> None:
    """Without fixed-K rows: each row's speedup over its target alone, per prompt category."""
    rows = [r for r in rows if r.get("categories") and r.get("speedup_vs_target_alone")]
    names = sorted({c for r in rows for c in r["categories"]})
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        speeds = [row["categories"].get(c, {}).get("speedup_vs_target_alone", 0) for c in names]
        xs = [j + i * width for j in range(len(names))]
        axes.bar(xs, speeds, width, label=row["name"])
    axes.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
    axes.set_ylabel("speedup over the target alone (end to end)")
    axes.set_title("per category")
    if rows:
        axes.legend(fontsize=7)


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    fig, (left, right, curves) = plt.subplots(1, 3, figsize=(18, 5.2))
    names = [r["name"] for r in rows]
    speed = [r["speedup_vs_pytorch"] or r["tokens_per_s"] for r in rows]
    left.barh(names, speed, color=["#888" if not n.startswith("specrt") else "#2a7" for n in names])
    left.set_xlabel(
        "speedup vs PyTorch baseline" if rows and rows[0]["speedup_vs_pytorch"] else "tokens/s"
    )
    left.invert_yaxis()
    if _fixed_rows(rows):
        _chart_fixed(right, rows)
    else:
        _chart_categories(right, rows)
    for label, c in result.get("costs", {}).items():
        counts = sorted(int(n) for n in c["verify_ratio"])
        ratios = {int(n): v for n, v in c["verify_ratio"].items()}
        curves.plot([n - 1 for n in counts], [ratios[n] for n in counts], "o-", label=label)
    curves.set_xlabel("K drafts verified (K+1 new tokens)")
    curves.set_ylabel("c_verify(K) / c_verify(0)")
    curves.set_title("verify cost curve (target)")
    if curves.lines:
        curves.legend(fontsize=8)
    fig.suptitle(f"specrt bench: {Path(result['bundle']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
