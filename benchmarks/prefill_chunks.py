"""What chunked prefill buys the requests already running: a long prompt joins a batch while a
chat answer streams, at several chunk sizes.

The streaming request (a short chat prompt) runs alone until it has a few tokens; then a file
rewrite (the longest prompt of `benchmarks/prompts/predicted_files.jsonl`) joins. Per chunk
size: the streaming request's longest wait between tokens (the stall the joining prompt
causes: its chunks, and the draft model's reading of it), the joining request's time to first
token, prefill speed and decode speed, and whether both outputs equal their runs alone. Greedy,
adaptive speculation, no prompt cache. `--joining` sets the joining request's new tokens: with
the default 16 it does not draft; with 128 its draft model reads its window of the prompt.

    python benchmarks/prefill_chunks.py BUNDLE [--chunks 0,512,256,128,64] [--joining 16] \
        [--out benchmarks/results/cpu-prefill-chunks]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result
from specrt.runtime import Scheduler, SpeculativeRuntime

HERE = Path(__file__).resolve().parent
CHAT = [{"role": "user", "content": "Explain how a hash map handles collisions."}]
STREAMED, JOINING = 128, 16  # new tokens of each
JOIN_AFTER = 8  # tokens the streaming request has when the long prompt arrives


def longest_file_prompt() -> list[dict]:
    lines = (HERE / "prompts" / "predicted_files.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return max(items, key=lambda item: len(json.dumps(item["messages"])))["messages"]


def scenario(
    rt: SpeculativeRuntime, chunk: int | None, joining_prompt: list[dict], answer: int
) -> dict:
    """The streaming request, then the long prompt joining it, stepped to the end."""
    scheduler = Scheduler(rt.target, rt.costs, slots=2, chunk=chunk)
    streaming = rt.sequence(CHAT, max_new_tokens=STREAMED, ignore_eos=True)
    scheduler.add(streaming)
    while streaming.stops.length < JOIN_AFTER:
        scheduler.step()
    joining = rt.sequence(joining_prompt, max_new_tokens=answer, ignore_eos=True)
    scheduler.add(joining)
    joined = time.perf_counter()
    first = None
    while streaming.result is None or joining.result is None:
        scheduler.step()
        if first is None and joining.stops.length:
            first = time.perf_counter() - joined
    return {
        "chunk": chunk or 0,
        "longest_stall_s": max(_waits(streaming.result.stats.token_times)),
        "streamed_tokens_per_s": streaming.result.stats.tokens_per_second,
        "joining_ttft_s": first,
        "joining_prompt_tokens": joining.result.stats.prompt_tokens,
        "joining_prefill_s": joining.result.stats.prefill_seconds,
        "joining_decode_tokens_per_s": _decode_speed(joining.result.stats),
        "joining_accepted": [joining.result.stats.accepted, joining.result.stats.drafted],
        "tokens": {"streaming": streaming.result.token_ids, "joining": joining.result.token_ids},
    }


def _decode_speed(stats) -> float:
    return (stats.new_tokens - 1) / max(stats.total_seconds - stats.ttft_seconds, 1e-9)


def _waits(times: list[float]) -> list[float]:
    """The waits between blocks of tokens (a round emits its block at once)."""
    moments = sorted(set(times))
    return [later - earlier for earlier, later in zip(moments, moments[1:], strict=False)]


def markdown(result: dict) -> str:
    lines = [
        "# Chunked prefill: a long prompt joins a streaming answer",
        "",
        f"A chat answer streams ({STREAMED} tokens); after {JOIN_AFTER} of them a file rewrite "
        f"of {result['rows'][0]['joining_prompt_tokens']} prompt tokens joins "
        f"({result.get('joining', JOINING)} new). "
        f"Greedy, adaptive; `{result['command']}`",
        "",
        "| chunk | streaming: longest stall | streaming tok/s | joining: first token "
        "| joining: prefill tok/s | joining: decode tok/s, accepted | outputs as alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        label = row["chunk"] or "whole prompt"
        speed = row["joining_prompt_tokens"] / row["joining_prefill_s"]
        decode = "–"  # not recorded before --joining
        if "joining_accepted" in row:
            accepted, drafted = row["joining_accepted"]
            decode = f"{row['joining_decode_tokens_per_s']:.1f}, {accepted}/{drafted}"
        lines.append(
            f"| {label} | {row['longest_stall_s']:.2f} s | {row['streamed_tokens_per_s']:.1f} | "
            f"{row['joining_ttft_s']:.2f} s | {speed:.0f} | {decode} | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--chunks", default="0,512,256,128,64", show_default=True, help="0: whole.")
@click.option("--joining", default=JOINING, show_default=True, help="Its new tokens.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-prefill-chunks"))
def main(bundle: Path, chunks: str, joining: int, out: Path) -> None:
    rt = SpeculativeRuntime.load(bundle, slots=2, prompt_cache=False)
    joining_prompt = longest_file_prompt()
    alone = {
        "streaming": rt.generate(CHAT, max_new_tokens=STREAMED, ignore_eos=True).token_ids,
        "joining": rt.generate(joining_prompt, max_new_tokens=joining, ignore_eos=True).token_ids,
    }
    rows = []
    for chunk in (int(c) or None for c in chunks.split(",")):
        row = scenario(rt, chunk, joining_prompt, joining)
        row["identical"] = row.pop("tokens") == alone
        rows.append(row)
        stall, ttft = row["longest_stall_s"], row["joining_ttft_s"]
        print(f"chunk {chunk}: stall {stall:.2f} s, first token {ttft:.2f} s", flush=True)
    result = {
        "kind": "prefill_chunks",
        "machine": machine.describe(),
        "command": "python benchmarks/prefill_chunks.py BUNDLE "
        f"--chunks {chunks} --joining {joining}",
        "joining": joining,
        "bundle": str(bundle),
        "rows": rows,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
