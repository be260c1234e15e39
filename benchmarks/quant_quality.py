"""Quality and speed of each precision combination, side by side: cpu-quant-quality.{json,md}.

Speed comes from one `specrt bench` run over several bundles (rows measured side by side);
quality from `specrt eval --json` per bundle (each role against its float32 source, on 512 tokens
of json/decoder.py and of the prose sample). A role's quality does not depend on its partner, so
a combination takes each role's figures from whichever evaluated bundle holds that role at that
precision.

    python benchmarks/quant_quality.py --bench BENCH.json --eval E1.json --eval E2.json \
        --out benchmarks/results/cpu-quant-quality
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result


def _role_quality(evals: list[dict]) -> dict[tuple[str, str], dict]:
    """(role, precision) -> {text: summary}, from eval results whose bundles were labelled."""
    found = {}
    for e in evals:
        for role, texts in e["roles"].items():
            found[(role, e["precisions"][role])] = texts
    return found


def combine(bench: dict, evals: list[dict]) -> dict:
    quality = _role_quality(evals)
    rows = {r["name"]: r for r in bench["configs"]}
    combos = []
    for label, roles in bench["quality"].items():
        suffix = "" if label == "d-fp32_t-fp32" else f"_{label}"
        alone, adaptive = (
            rows.get(f"specrt_target_only{suffix}"),
            rows.get(f"specrt_adaptive{suffix}"),
        )
        combos.append(
            {
                "bundle": label,
                "target_alone_tokens_per_s": alone and alone["tokens_per_s"],
                "adaptive_tokens_per_s": adaptive and adaptive["tokens_per_s"],
                "adaptive_identical_to_target_alone": adaptive
                and adaptive["identical_to_target_alone"],
                "acceptance": adaptive and adaptive["acceptance_rate"],
                "roles": {
                    role: {"precision": q["precision"], "eval": quality.get((role, q["precision"]))}
                    for role, q in roles.items()
                },
            }
        )
    return {
        "kind": "quant_quality",
        "machine": bench["machine"],
        "settings": bench["settings"],
        "combinations": combos,
    }


def _cell(texts: dict | None, key: str, spec: str) -> str:
    if texts is None:
        return "0 (the reference)" if key.startswith("kl") else "–"
    return " / ".join(format(texts[t][key], spec) for t in sorted(texts))


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "# Precision: quality against float32 and speed, side by side",
        "",
        f"{machine.label(m)}; {m['date']}; speed: {s['prompts']} prompts × "
        f"{s['max_new_tokens']} new tokens, greedy, one run. Quality: `specrt eval`, 511 scored "
        "tokens each of json/decoder.py / prose.txt, against the role's float32 source.",
        "",
        "| bundle | role | precision | KL mean | KL p99 | top-1 | perplexity change "
        "| target alone tok/s | adaptive tok/s | adaptive = target alone |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["combinations"]:
        for i, (role, q) in enumerate(c["roles"].items()):
            speed = (
                f"| {c['target_alone_tokens_per_s']:.2f} | {c['adaptive_tokens_per_s']:.2f} "
                f"| {c['adaptive_identical_to_target_alone']} |"
                if i == len(c["roles"]) - 1 and c["adaptive_tokens_per_s"]
                else "| | | |"
            )
            lines.append(
                f"| {c['bundle'] if i == 0 else ''} | {role} | {q['precision']} "
                f"| {_cell(q['eval'], 'kl_mean', '.4f')} | {_cell(q['eval'], 'kl_p99', '.3f')} "
                f"| {_cell(q['eval'], 'top1_agreement', '.1%')} "
                f"| {_cell(q['eval'], 'perplexity_change', '+.1%')} {speed}"
            )
    lines += ["", "Figures per text are json/decoder.py / prose.txt.", ""]
    return "\n".join(lines)


@click.command()
@click.option("--bench", "bench_path", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--eval", "eval_paths", multiple=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Path stem.")
def main(bench_path: Path, eval_paths: tuple[Path, ...], out: Path) -> None:
    bench = json.loads(bench_path.read_text())
    evals = []
    for path in eval_paths:
        e = json.loads(path.read_text())
        manifest = json.loads((Path(e["bundle"]).expanduser() / "manifest.json").read_text())
        e["precisions"] = {r: manifest["roles"][r]["precision"]["weights"] for r in e["roles"]}
        evals.append(e)
    result = combine(bench, evals)
    write_result(out, result, markdown(result))
    click.echo(markdown(result))


if __name__ == "__main__":
    main()
