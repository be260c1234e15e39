"""Long prompts, one request at a time: time to first token and peak memory as the prompt grows,
with the prompt fed to the engine whole or in pieces of several sizes.

The prompt is specrt's own runtime, serve and engines source (a snapshot, SOURCE), cut to N tokens,
with a question after it, as a chat message; the target alone answers (greedy, 8 new tokens,
prompt cache off). Each row runs in a process of its own, so its peak RSS
(`resource.getrusage`) is its own; the engines loaded take part of it (`loaded`).

    python benchmarks/long_context.py BUNDLE [--sizes 1000,3000,6000] [--pieces 0,512,256] \
        [--out benchmarks/results/cpu-long-context]
    python benchmarks/long_context.py BUNDLE --speculation [--task chat] [--answer 64] \
        [--sizes 1000,4000,8000] [--runs target,fixed:1,adaptive] [--repeat 3] \
        [--llama-cpp DIR] [--out benchmarks/results/cpu-long-context-speculation]

`--speculation` answers `--answer` tokens with the target alone, then with adaptive speculation
whose draft model reads the prompt's last 512 tokens (the default `--draft-window`) and with one
that reads it whole. Each run has a runtime of its own, over its own slots of one pair of
engines (one copy of the weights: engines/slot_range.py); the target alone's pays the prompt's
prefill (the row's first token) and the others get a copy of its slots (the same numbers, one
prefill a row where there was one a run; the prompt cache keeps it in the slot), and the
runs then answer round by round in turn: one round of each, then the next, so that the
machine's drift (10 % within a minute on a shared 2-core machine) falls on every run alike.
A run's speed is its tokens after the first over the seconds of its own rounds, the draft
model's catch-up included; each run starts from one calibration of the costs at its slots, no
acceptance seen and an empty draft slot (a run's rounds would otherwise set the next one's
course, and a window left in the slot was read for free); with `--clients`, a run's acceptance
pool is kept from its first turn on, as a server keeps it, so only the first turn pays the
warm-up of a server that has seen no drafts. `--task completion` sends the cut
source as plain text to continue (code completion, as an editor sends a file) instead of a
chat question about it; `--task summary` asks for a summary of it, `--task system` sends it as
a long system prompt with a short question after it (TASKS). `--runs target,fixed:1,fixed:3,
adaptive` sets the runs side by side (any of target, whole, unscouted, adaptive, fixed:K;
`unscouted` reads the window from the first draft, without the scout of
`ModelDrafter.start`; the table then gives adaptive against the better of the target alone
and the best fixed K). `--repeat N` runs N such turns and gives each run's mean and every
turn's speed. `--clients N` gives each run N requests at once, each after its own cut of the
source. With `--llama-cpp DIR` (a folder with llama-server, or $SPECRT_LLAMA_CPP, or PATH),
llama-server gets the same prompts' token ids on the bundle's GGUF files, alone and with the
draft GGUF, a slot per client (`--clients` prompts sent at once), as many threads as cores,
`cache_prompt` off. `specrt verdict RESULT.json [more]`
judges adaptive's goal in each cell on its turns' spread (the runs table's verdict column).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import click

from specrt import machine
from specrt.files import write_result

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "prompts" / "long-source.txt"
QUESTION = "\n\nWhat does the code above do? Answer briefly."
TASKS = {
    "chat": "a source file cut to N tokens and a question about it, as a chat message",
    "summary": "a source file cut to N tokens and a request to summarise it, as a chat message",
    "system": "a source file cut to N tokens as a long system prompt, and a short question",
    "completion": "a source file cut to N tokens, continued as plain text (code completion)",
}
SUMMARY = "\n\nSummarise the code above: what each part is for, in a few paragraphs."
ASKED = "Which classes does the reference code define, and what is each one for?"
RUNS = ("target", "whole", "adaptive")  # --runs' default; also fixed:K
NEW_TOKENS = 8
ANSWER = 64  # new tokens of the speculation rows, by default
CLIENT_OFFSET = 997  # --clients: tokens between the starts of the clients' cuts of the source


def source_text() -> str:
    """Real text to cut prompts from: specrt's runtime, serve and engines source, the first
    128 KB (32,542 tokens for Qwen2.5) as of 2026-11-27, kept in SOURCE. Read from the checkout
    at run time, the prompts changed with the code they measured: a 4,000-token cut reaches
    controller.py, so a cell moved between two commits for its text as well as its code."""
    return SOURCE.read_text()


def one(bundle: str, size: int, piece: int) -> dict:
    """One row, in this process: the prompt of `size` tokens fed in pieces of `piece` (0:
    whole)."""
    import specrt.engines.onnxruntime as engine
    from specrt.runtime import SpeculativeRuntime

    engine.PIECE = piece or 10**9
    rt = SpeculativeRuntime.load(bundle, prompt_cache=False, calibrate=False)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    text = rt.tokenizer.decode(rt.tokenizer.encode(source_text())[:size])
    prompt = [{"role": "user", "content": text + QUESTION}]
    result = rt.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, speculate=False)
    return {
        "size": size,
        "piece": piece,
        "prompt_tokens": result.stats.prompt_tokens,
        "ttft_s": round(result.stats.ttft_seconds, 2),
        "loaded_mb": round(loaded),
        "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "tokens": result.token_ids,
    }


def task_prompt(task: str, text: str):
    """The prompt a task sends around the cut source text."""
    if task == "completion":
        return text
    if task == "system":
        return [{"role": "system", "content": text}, {"role": "user", "content": ASKED}]
    return [{"role": "user", "content": text + (SUMMARY if task == "summary" else QUESTION)}]


def markdown(result: dict) -> str:
    if result.get("mode") == "speculation":
        import long_answers

        return long_answers.markdown(result)
    pieces = result["pieces"]
    names = ["fed whole" if p == 0 else f"pieces of {p}" for p in pieces]
    lines = [
        "# Long prompts: first token and peak memory",
        "",
        f"The target alone, one request, greedy, {NEW_TOKENS} new tokens, prompt cache off; "
        "a source file cut to N tokens and a question. Each cell: time to first token, peak "
        f"RSS (the engines loaded: {result['loaded_mb'] / 1024:.1f} GB); = : every column's "
        f"output is the same. `{result['command']}`",
        "",
        "| prompt tokens | " + " | ".join(names) + " | = |",
        "|---" * (len(names) + 2) + "|",
    ]
    for size in result["sizes"]:
        rows = [r for r in result["rows"] if r["size"] == size]
        cells = [f"{r['ttft_s']:.1f} s, {r['peak_mb'] / 1024:.1f} GB" for r in rows]
        same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
        count = f"{rows[0]['prompt_tokens']:,}"
        lines.append(f"| {count} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--sizes", default="1000,3000,6000", show_default=True, help="Prompt tokens.")
@click.option("--pieces", default="0,512,256", show_default=True, help="0: the prompt whole.")
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-long-context"))
@click.option("--speculation", is_flag=True, help="Target alone against adaptive, per size.")
@click.option("--llama-cpp", type=click.Path(path_type=Path), help="--speculation: llama-server.")
@click.option("--task", type=click.Choice(list(TASKS)), default="chat", show_default=True)
@click.option("--answer", default=ANSWER, show_default=True, help="--speculation: new tokens.")
@click.option(
    "--runs",
    default=",".join(RUNS),
    show_default=True,
    help="--speculation: target, whole, adaptive and fixed:K runs, side by side.",
)
@click.option(
    "--repeat", default=1, show_default=True, help="--speculation: turns of the runs, in turn."
)
@click.option("--clients", default=1, show_default=True, help="--speculation: requests at once.")
@click.option("--one", "one_row", nargs=2, type=int, default=None, hidden=True)
def main(
    bundle: Path,
    sizes: str,
    pieces: str,
    out: Path,
    speculation: bool,
    llama_cpp,
    task: str,
    answer: int,
    runs: str,
    repeat: int,
    clients: int,
    one_row,
) -> None:
    """--task: what the --speculation prompts ask (see TASKS)."""
    import long_answers  # it imports this module's prompts and constants

    if one_row:
        size, piece = one_row
        if speculation:
            row = long_answers.speculation_row(
                str(bundle), size, task, answer, runs.split(","), repeat, clients
            )
            print(json.dumps(row))
        else:
            print(json.dumps(one(str(bundle), size, piece)))
        return
    if speculation:
        long_answers.compare(bundle, sizes, out, llama_cpp, task, answer, runs, repeat, clients)
        return
    rows = []
    for size in (int(n) for n in sizes.split(",")):
        for piece in (int(n) for n in pieces.split(",")):
            command = [sys.executable, __file__, str(bundle), "--one", str(size), str(piece)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.splitlines()[-1]))
            print(f"{size} tokens, piece {piece}: {rows[-1]['ttft_s']} s, {rows[-1]['peak_mb']} MB")
    result = {
        "kind": "long_context",
        "machine": machine.describe(),
        "command": f"python benchmarks/long_context.py BUNDLE --sizes {sizes} --pieces {pieces}",
        "bundle": str(bundle),
        "sizes": [int(n) for n in sizes.split(",")],
        "pieces": [int(n) for n in pieces.split(",")],
        "loaded_mb": min(r["loaded_mb"] for r in rows),
        "rows": rows,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
