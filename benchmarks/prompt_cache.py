"""What the prompt cache saves a conversation: the second turn of MT-bench's two-turn questions
(Spec-Bench's multi-turn category), timed with the cache and computed whole, outputs compared.

Each question runs its first turn, then its second (the first answer resent, as a chat client
does) twice on the same runtime: first with the cache, which reuses the first turn's prompt and
answer from the slot, then computed whole. With `--between N`, N other questions' first turns
run before the second turn: they take the runtime's one slot, so the second turn finds the
first only in the prefix store (`--prefix-cache`, host memory beyond the slots). Speculation
as served by default (adaptive), EOS ends an answer. With `--llama-cpp DIR`, llama-server on
the bundle's target GGUF gets the same token ids: its slot primed with the first turn's prompt
and specrt's answer, then the second turn with `cache_prompt` and without.

    python benchmarks/prompt_cache.py BUNDLE [--questions ../shared/specbench/question.jsonl] \
        [--count 8] [--max-new-tokens 128] [--between N --prefix-cache 4GB] [--llama-cpp DIR] \
        [--out benchmarks/results/cpu-prompt-cache]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.budget import parse_bytes
from specrt.runtime.prefix_store import PrefixStore
from specrt.runtime.prompt_cache import PromptCache
from specrt.tools import llamacpp


def turn(
    rt: SpeculativeRuntime, messages: list[dict], max_new: int, cache: PromptCache | None
) -> dict:
    """One chat turn: its answer, time to first token and in all, and what the cache held."""
    rt.prompt_cache = cache
    start = time.perf_counter()
    generation = rt.stream(messages, max_new_tokens=max_new)
    first = None
    for _ in generation:
        first = first or time.perf_counter()
    end = time.perf_counter()
    result = generation.result
    return {
        "text": result.text,
        "tokens": result.token_ids,
        "prompt_tokens": result.stats.prompt_tokens,
        "cached_tokens": result.stats.cached_tokens,
        "ttft_s": (first or end) - start,
        "seconds": end - start,
    }


def question(
    rt: SpeculativeRuntime, turns: list[str], max_new: int, cache: PromptCache, between: list
) -> tuple[dict, list, list]:
    """A question's second turn, with the cache (after the first turns of `between`, other
    questions) and computed whole; and the token ids a slot holds after the first turn and
    the second turn's prompt (for llama-server)."""
    asked = [{"role": "user", "content": turns[0]}]
    answer = turn(rt, asked, max_new, None)
    second = [*asked, {"role": "assistant", "content": answer["text"]}]
    second.append({"role": "user", "content": turns[1]})
    for other in between:
        turn(rt, [{"role": "user", "content": other[0]}], max_new, cache)
    cached = turn(rt, second, max_new, cache)
    whole = turn(rt, second, max_new, None)
    row = {
        "prompt_tokens": whole["prompt_tokens"],
        "cached_tokens": cached["cached_tokens"],
        "ttft_s": {"cached": cached["ttft_s"], "whole": whole["ttft_s"]},
        "seconds": {"cached": cached["seconds"], "whole": whole["seconds"]},
        "new_tokens": {"cached": len(cached["tokens"]), "whole": len(whole["tokens"])},
        "identical": cached["tokens"] == whole["tokens"],
    }
    return row, [*rt.encode(asked), *answer["tokens"]], rt.encode(second)


def llama_turns(base: str, held: list[int], prompt: list[int], max_new: int) -> dict:
    """llama-server's second turn, its slot holding `held`: with cache_prompt, then without."""
    llamacpp.complete(base, held, 1, cache_prompt=True)
    row: dict = {"ttft_s": {}, "seconds": {}, "new_tokens": {}}
    outputs = []
    for how, cache in (("cached", True), ("whole", False)):
        start = time.perf_counter()
        tokens, times = llamacpp.complete(base, prompt, max_new, False, cache_prompt=cache)
        seconds = time.perf_counter() - start
        row["ttft_s"][how] = times[0] if times else seconds
        row["seconds"][how] = seconds
        row["new_tokens"][how] = len(tokens)
        outputs.append(tokens)
    row["identical"] = outputs[0] == outputs[1]
    return row


def summary(rows: list[dict]) -> dict:
    def total(field: str, how: str) -> float:
        return sum(r[field][how] for r in rows)

    prompts = sum(r["prompt_tokens"] for r in rows)
    return {
        "questions": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
        "cached_share": sum(r["cached_tokens"] for r in rows) / prompts,
        "ttft_s_mean": {h: total("ttft_s", h) / len(rows) for h in ("cached", "whole")},
        "ttft_speedup": total("ttft_s", "whole") / total("ttft_s", "cached"),
        "turn_speedup": total("seconds", "whole") / total("seconds", "cached"),
    }


def markdown(result: dict) -> str:
    s, llama = result["summary"], result.get("llama_server")
    where = "prefix store" if result.get("between") else "slot"
    lines = [
        "# Prompt cache: a conversation's second turn",
        "",
        f"{s['questions']} MT-bench questions (Spec-Bench's multi-turn), second turn, "
        f"up to {result['max_new_tokens']} tokens, adaptive speculation; `{result['command']}`",
        "",
        "| second turn | time to first token (mean) | tokens | seconds | tokens/s |",
        "|---|---|---|---|---|",
        _line("specrt, computed whole", result["rows"], "whole"),
        _line("specrt, prompt cache", result["rows"], "cached"),
    ]
    if llama:
        lines.append(_line("llama-server, computed whole", llama["rows"], "whole"))
        lines.append(_line("llama-server, `cache_prompt`", llama["rows"], "cached"))
    lines += [
        "",
        f"Prompts of {s['prompt_tokens_mean']:.0f} tokens on average, "
        f"{100 * s['cached_share']:.0f} % of them reused from the {where}: the first token "
        f"{s['ttft_speedup']:.2f}× sooner, the turn {s['turn_speedup']:.2f}× faster; "
        f"{s['identical']} of {s['questions']} outputs identical to the prompt computed whole.",
    ]
    if llama:
        same, count = sum(r["identical"] for r in llama["rows"]), len(llama["rows"])
        lines.append(f"llama-server: {same} of {count} identical with `cache_prompt` and without.")
    return "\n".join(lines) + "\n"


def _line(label: str, rows: list[dict], how: str) -> str:
    """One table row: the runs' mean time to first token and their totals."""
    ttft = 1000 * statistics.mean(r["ttft_s"][how] for r in rows)
    tokens = sum(r["new_tokens"][how] for r in rows)
    seconds = sum(r["seconds"][how] for r in rows)
    return f"| {label} | {ttft:.0f} ms | {tokens} | {seconds:.1f} | {tokens / seconds:.2f} |"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--questions",
    type=click.Path(exists=True, path_type=Path),
    default=Path("../shared/specbench/question.jsonl"),
    show_default=True,
)
@click.option("--count", default=8, show_default=True, help="Questions, spread over categories.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--between", default=0, show_default=True, help="Other first turns in between.")
@click.option("--prefix-cache", default="0", show_default=True, help="The prefix store's size.")
@click.option("--llama-cpp", type=click.Path(path_type=Path), help="llama-server's folder.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-prompt-cache"))
def main(
    bundle: Path,
    questions: Path,
    count: int,
    max_new_tokens: int,
    between: int,
    prefix_cache: str,
    llama_cpp,
    out: Path,
) -> None:
    items = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    two_turn = [q for q in items if len(q.get("turns", ())) == 2]
    step = max(1, len(two_turn) // count)
    chosen = two_turn[::step][:count]
    rt = SpeculativeRuntime.load(bundle, prompt_cache=False)
    rt.generate("Hello", max_new_tokens=4)  # warm-up: first runs allocate
    size = parse_bytes(prefix_cache, "--prefix-cache")
    cache = PromptCache(PrefixStore(size) if size else None)
    rows, replays = [], []
    for i, q in enumerate(chosen):
        others = [two_turn[(i * step + 1 + j) % len(two_turn)]["turns"] for j in range(between)]
        row, *replay = question(rt, q["turns"], max_new_tokens, cache, others)
        replays.append(replay)
        rows.append({"question_id": q.get("question_id"), "category": q.get("category"), **row})
        print(f"{i + 1}/{len(chosen)} {q.get('category')}: prompt {row['prompt_tokens']}, "
              f"cached {row['cached_tokens']}, first token {row['ttft_s']['cached']:.2f} s "
              f"vs {row['ttft_s']['whole']:.2f} s", flush=True)  # fmt: skip
    result = {
        "kind": "prompt_cache",
        "machine": machine.describe(),
        "command": f"python benchmarks/prompt_cache.py BUNDLE --count {count} "
        f"--max-new-tokens {max_new_tokens}"
        + (f" --between {between} --prefix-cache {prefix_cache}" if between else "")
        + (" --llama-cpp DIR" if llama_cpp else ""),
        "bundle": str(bundle),
        "max_new_tokens": max_new_tokens,
        "between": between,
        "rows": rows,
        "summary": summary(rows),
        "llama_server": llama_server(rt, llama_cpp, replays, max_new_tokens),
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


def llama_server(rt: SpeculativeRuntime, folder, replays: list, max_new: int) -> dict | None:
    """The same second turns on llama-server (one slot), where a build and the GGUF are here."""
    binary, files = llamacpp.find_server(folder), llamacpp.gguf_sources(rt.bundle)
    if binary is None or "target" not in files:
        print(llamacpp.MISSING if binary is None else "llama rows skipped: no target GGUF")
        return None
    threads, context = os.cpu_count(), rt.bundle.max_context  # specrt's engines use every core
    spec = llamacpp.ServerSpec(binary, files["target"], threads=threads, context=context)
    with llamacpp.serving(spec) as base:
        llamacpp.complete(base, replays[0][1][:8], 4)  # warm-up
        rows = [llama_turns(base, held, prompt, max_new) for held, prompt in replays]
    return {"command": " ".join(spec.command(0)), "rows": rows}


if __name__ == "__main__":
    main()
