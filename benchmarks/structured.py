"""Constrained output through `specrt serve`: the constrained target alone, constrained
speculation, and constrained speculation with the grammar's forced tokens drafted for free, on
an extraction set (invoices, contacts, code metadata, events, ...: benchmarks/prompts/
extraction.json), greedy, side by side in one run.

    python benchmarks/structured.py BUNDLE [BUNDLE ...] [--out benchmarks/results/cpu-structured]

Each item is a chat request with OpenAI's response_format json_schema, sent with the official
client to a server started as a user starts it (`specrt serve BUNDLE`). For every item the three
ways run one after the other (the machine's drift touches all alike); each must give the same
text, which must parse and validate against the item's schema. tokens/s is completion tokens
over wall time from the client's side, summed over the set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import openai
from serve_overhead import free_port, start_server

from specrt import machine
from specrt.bundle import Bundle
from specrt.files import write_result

SET = Path(__file__).with_name("prompts") / "extraction.json"
SYSTEM = "Extract the requested fields from the user's text. Answer with JSON only."
WAYS = {  # the speculation field each way sends
    "target alone": "off",
    "speculation": {"controller": "adaptive", "jump_forward": False},
    "speculation + forced tokens": {"controller": "adaptive"},
}


def ask(api: openai.OpenAI, item: dict, speculation, max_tokens: int) -> dict:
    start = time.perf_counter()
    reply = api.chat.completions.create(
        model="specrt",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["text"]}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True},
        },
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"speculation": speculation},
    )
    seconds = time.perf_counter() - start
    text = reply.choices[0].message.content
    valid = reply.choices[0].finish_reason == "stop"
    if valid:
        try:
            jsonschema.validate(json.loads(text), item["schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = False
    spec = reply.model_extra.get("speculation", {})
    return {
        "text": text,
        "tokens": reply.usage.completion_tokens,
        "seconds": seconds,
        "valid": valid,
        "target_calls": spec.get("target_calls"),
        "acceptance": spec.get("acceptance_rate"),
    }


def run_bundle(bundle: Path, items: list[dict], max_tokens: int) -> dict:
    port = free_port()
    server = start_server(bundle, port, "--model-name", "specrt")
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        ask(api, items[0], "off", 16)  # warm-up: first calls pay for allocations
        runs = {way: [] for way in WAYS}
        for item in items:
            for way, speculation in WAYS.items():
                runs[way].append({"item": item["name"], **ask(api, item, speculation, max_tokens)})
                print(bundle.name, item["name"], way, runs[way][-1]["tokens"],
                      f"{runs[way][-1]['seconds']:.1f}s", flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    alone = [r["text"] for r in runs["target alone"]]
    summary = {}
    for way, rows in runs.items():
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        summary[way] = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "target_calls": sum(r["target_calls"] or 0 for r in rows),
            "identical_to_target_alone": sum(
                r["text"] == a for r, a in zip(rows, alone, strict=True)
            ),
            "valid": sum(r["valid"] for r in rows),
        }
    base = summary["target alone"]["tokens_per_second"]
    for row in summary.values():
        row["speedup"] = row["tokens_per_second"] / base
    precision = Bundle.load(bundle).precision_label
    return {"bundle": str(bundle), "precision": precision, "summary": summary, "runs": runs}


def markdown(result: dict) -> str:
    lines = [
        "# Constrained output: the constrained target alone, speculation, forced tokens",
        "",
        f"Machine: {machine.label(result['machine'])}. Command: `{result['command']}`",
        "",
        f"{result['items']} extraction requests (response_format json_schema, greedy, through "
        "`specrt serve` with the openai client); tokens/s over the whole set.",
        "",
        "| bundle | way | tokens/s | speedup | target calls | identical | valid |",
        "|---|---|---|---|---|---|---|",
    ]
    for bundle in result["bundles"]:
        for way, row in bundle["summary"].items():
            lines.append(
                f"| {bundle['precision']} | {way} | {row['tokens_per_second']:.1f} | "
                f"{row['speedup']:.2f}x | {row['target_calls']} | "
                f"{row['identical_to_target_alone']}/{result['items']} | "
                f"{row['valid']}/{result['items']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--limit", type=int, default=None, help="the first N items only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-structured"))
    args = parser.parse_args()
    items = json.loads(SET.read_text())[: args.limit]
    result = {
        "kind": "structured",
        "machine": machine.describe(),
        "command": "python benchmarks/structured.py " + " ".join(sys.argv[1:]),
        "items": len(items),
        "bundles": [run_bundle(b, items, args.max_tokens) for b in args.bundles],
    }
    write_result(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
