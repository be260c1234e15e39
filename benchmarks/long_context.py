"""Long prompts, one request at a time: time to first token and peak memory as the prompt grows,
with the prompt fed to the engine whole or in pieces of several sizes.

The prompt is specrt's own runtime, serve and engines source (this checkout's), cut to N tokens,
with a question after it, as a chat message; the target alone answers (greedy, 8 new tokens,
prompt cache off). Each row runs in a process of its own, so its peak RSS
(`resource.getrusage`) is its own; the engines loaded take part of it (`loaded`).

    python benchmarks/long_context.py BUNDLE [--sizes 1000,3000,6000] [--pieces 0,512,256] \
        [--out benchmarks/results/cpu-long-context]
    python benchmarks/long_context.py BUNDLE --speculation [--task chat] [--answer 64] \
        [--sizes 1000,4000,8000] \
        [--llama-cpp DIR] [--out benchmarks/results/cpu-long-context-speculation]

`--speculation` answers `--answer` tokens with the target alone, then with adaptive speculation
whose draft model reads the prompt's last 512 tokens (the default `--draft-window`) and with one
that reads it whole. The target alone pays the prefill (its first token is the row's); the
speculating runs start from the target's prefix in its slot (the prompt cache), so each pays
only its own decode, the draft model's catch-up included (the draft's slot is emptied
before each run: a run that found the last one's window there read it for free, and the
order of the runs set who paid), and each starts from the costs
calibrated at load and no acceptance seen (a run's rounds would otherwise set the next one's
course). `--task completion` sends the cut
source as plain text to continue (code completion, as an editor sends a file) instead of a
chat question about it; `--task summary` asks for a summary of it, `--task system` sends it as
a long system prompt with a short question after it (TASKS). `--runs target,fixed:1,fixed:3,
adaptive` sets the runs side by side (any of target, whole, unscouted, adaptive, fixed:K;
`unscouted` reads the window from the first draft, without the scout of
`ModelDrafter.start`; the table then gives adaptive against the better of the target alone
and the best fixed K). With
`--llama-cpp DIR` (a folder with llama-server, or
$SPECRT_LLAMA_CPP, or PATH), llama-server gets the same prompt's token ids on the bundle's GGUF
files, alone and with the draft GGUF, one slot, as many threads, `cache_prompt` off.
"""

from __future__ import annotations

import copy
import json
import resource
import subprocess
import sys
from pathlib import Path

import click

from specrt import machine
from specrt.bundle import Bundle
from specrt.files import write_result
from specrt.tools import llamacpp

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent / "src" / "specrt"
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


def source_text() -> str:
    """Real text to cut prompts from: this checkout's runtime, serve and engines source."""
    folders = ("runtime", "serve", "engines")
    return "".join(p.read_text() for d in folders for p in sorted((PACKAGE / d).glob("*.py")))


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


def speculation_row(bundle: str, size: int, task: str, answer: int, runs: list[str]) -> dict:
    """One size, in this process: each run (the target alone, adaptive speculation reading the
    prompt whole or in its window, fixed:K) answering `answer` tokens after the same prompt
    (the speculating runs from the target alone's prefix in the slot), each from the
    calibrated costs and a fresh acceptance pool."""
    from specrt.runtime import SpeculativeRuntime
    from specrt.runtime.drafters import DRAFT_WINDOW, make_drafter
    from specrt.runtime.pool import PooledAcceptance

    rt = SpeculativeRuntime.load(bundle)
    calibrated = copy.deepcopy(rt.costs)
    text = rt.tokenizer.decode(rt.tokenizer.encode(source_text())[:size])
    prompt = task_prompt(task, text)
    row = {"size": size, "prompt_ids": rt.encode(prompt), "window": DRAFT_WINDOW}
    known = {
        "target": {"speculate": False},
        "whole": {"drafter": make_drafter("model", rt.draft, window=None)},
        "unscouted": {"drafter": make_drafter("model", rt.draft, scout=False)},
        "adaptive": {},
    }
    for name in ["target", *(r for r in runs if r != "target")]:  # the target pays the prefill
        options = known.get(name) or {"controller": name}
        rt.costs, rt.acceptance = copy.deepcopy(calibrated), PooledAcceptance()
        for slot in range(rt.draft.slots):  # each run pays its own draft model's reading
            rt.draft.reset(slot)
        result = rt.generate(prompt, max_new_tokens=answer, ignore_eos=True, **options)
        s = result.stats
        row["prompt_tokens"] = s.prompt_tokens
        row[name] = {
            "ttft_s": round(s.ttft_seconds, 2),
            "decode_tokens_per_s": round(
                (s.new_tokens - 1) / (s.total_seconds - s.ttft_seconds), 2
            ),
            "mean_k": round(sum(s.ks) / max(1, len(s.ks)), 2),
            "accepted": s.accepted,
            "drafted": s.drafted,
            "tokens": result.token_ids,
        }
    return row


def llama_rows(bundle: Path, folder: Path | None, rows: list[dict]) -> dict | None:
    """llama-server on the same prompts' token ids, alone and with the draft GGUF (None where
    no build or no GGUF is here)."""
    b = Bundle.load(bundle)
    binary, files = llamacpp.find_server(folder), llamacpp.gguf_sources(b)
    if binary is None or "target" not in files:
        print(llamacpp.MISSING if binary is None else "llama rows skipped: no target GGUF")
        return None
    threads, context = machine.describe()["cores"], b.max_context
    specs = {"alone": llamacpp.ServerSpec(binary, files["target"], None, 0, threads, context)}
    if "draft" in files:
        specs["draft"] = llamacpp.ServerSpec(
            binary, files["target"], files["draft"], b.max_draft, threads, context
        )
    out: dict = {"commands": {}}
    for name, spec in specs.items():
        out["commands"][name] = " ".join(spec.command(0))
        with llamacpp.serving(spec) as base:
            llamacpp.complete(base, rows[0]["prompt_ids"][:8], 4)  # warm-up
            for row in rows:
                tokens, times = llamacpp.complete(
                    base, row["prompt_ids"], len(row["target"]["tokens"])
                )
                row[f"llama_{name}"] = {
                    "ttft_s": round(times[0], 2),
                    "decode_tokens_per_s": round((len(times) - 1) / (times[-1] - times[0]), 2),
                    "tokens": tokens,
                }
                print(f"llama-server {name}, {row['size']} tokens: {row[f'llama_{name}']}")
    return out


def markdown(result: dict) -> str:
    if result.get("mode") == "speculation":
        return _speculation_markdown(result)
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


def _speculation_markdown(result: dict) -> str:
    if tuple(result.get("runs", RUNS)) != RUNS:
        return _runs_markdown(result)
    llama = result.get("llama_server") is not None
    lines = [
        "# Long prompts: what speculation gains after them",
        "",
        f"One request, greedy, {result.get('answer', ANSWER)} new tokens, the default draft "
        "and target; "
        f"{TASKS[result.get('task', 'chat')]}. The target alone pays the prefill; the "
        "speculating runs start from its prefix in the slot and pay their own decode, the draft "
        "model's catch-up included (decode: tokens after the first over their seconds; "
        f"accepted: drafts the target kept). `{result['command']}`",
        "",
        "| prompt tokens | target alone: first token, decode tok/s | adaptive, draft reads the "
        "whole prompt: tok/s, mean K, accepted | adaptive, draft reads its last "
        f"{result['rows'][0].get('window', 512)}: tok/s, mean K, accepted | gain | same output |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        alone, spec = row["target"], row["adaptive"]
        whole = row.get("whole")
        gain = spec["decode_tokens_per_s"] / alone["decode_tokens_per_s"]
        same = all(r["tokens"] == alone["tokens"] for r in (spec, whole) if r)
        lines.append(
            f"| {row['prompt_tokens']:,} | {alone['ttft_s']:.1f} s, "
            f"{alone['decode_tokens_per_s']:.2f} | {_run_cell(whole)} | {_run_cell(spec)} | "
            f"{gain:.2f}× | {'yes' if same else 'NO'} |"
        )
    if llama:
        lines += ["", *_llama_markdown(result)]
    return "\n".join(lines) + "\n"


def _runs_markdown(result: dict) -> str:
    """Any set of runs side by side; adaptive against the better of the target alone and the
    best fixed K (the goal: 0.97x at least)."""
    runs = [r for r in result["runs"] if r != "target"]
    lines = [
        "# Long prompts: what speculation gains after them",
        "",
        f"One request, greedy, {result['answer']} new tokens, the default draft and target; "
        f"{TASKS[result['task']]}. Each run: decode tok/s, mean K, drafts accepted; the "
        f"speculating runs start from the target alone's prefix in the slot. `{result['command']}`",
        "",
        "| prompt tokens | target alone: first token, tok/s | "
        + " | ".join(runs)
        + " | adaptive / better of off and fixed | same output |",
        "|---" * (len(runs) + 4) + "|",
    ]
    for row in result["rows"]:
        alone = row["target"]
        best = max(
            row[r]["decode_tokens_per_s"]
            for r in ["target", *runs]
            if r == "target" or r.startswith("fixed")
        )
        ratio = row["adaptive"]["decode_tokens_per_s"] / best if "adaptive" in row else None
        same = all(row[r]["tokens"] == alone["tokens"] for r in runs)
        cells = " | ".join(_run_cell(row[r]) for r in runs)
        lines.append(
            f"| {row['prompt_tokens']:,} | {alone['ttft_s']:.1f} s, "
            f"{alone['decode_tokens_per_s']:.2f} | {cells} | "
            f"{'–' if ratio is None else f'{ratio:.2f}×'} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _run_cell(run: dict | None) -> str:
    if run is None:
        return "–"
    kept = f"{run['accepted']}/{run['drafted']}" if "drafted" in run else "–"
    return f"{run['decode_tokens_per_s']:.2f}, K {run['mean_k']:.1f}, {kept}"


def _llama_markdown(result: dict) -> list[str]:
    """specrt beside llama-server: speeds as ratios (above 1: specrt is faster)."""
    commands = result["llama_server"]["commands"]
    lines = [
        "Beside llama-server on the same GGUF files and token ids (one slot, `cache_prompt` "
        "off): the first token (specrt's target alone) and decode speed (specrt adaptive), "
        "each as specrt's speed over llama-server's. "
        + "; ".join(f"{name}: `{command}`" for name, command in commands.items()),
        "",
        "| prompt tokens | first token: specrt / llama-server | speed | decode tok/s: specrt "
        "adaptive / llama-server alone / with its draft | vs alone | vs its draft |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ours, alone = row["target"], row["llama_alone"]
        spec, drafted = row["adaptive"], row.get("llama_draft")
        decode = spec["decode_tokens_per_s"]
        theirs = f"{alone['decode_tokens_per_s']:.2f}"
        versus = "–"
        if drafted:
            theirs += f" / {drafted['decode_tokens_per_s']:.2f}"
            versus = f"{decode / drafted['decode_tokens_per_s']:.2f}×"
        lines.append(
            f"| {row['prompt_tokens']:,} | {ours['ttft_s']:.1f} s / {alone['ttft_s']:.1f} s | "
            f"{alone['ttft_s'] / ours['ttft_s']:.2f}× | {decode:.2f} / {theirs} | "
            f"{decode / alone['decode_tokens_per_s']:.2f}× | {versus} |"
        )
    return lines


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
    one_row,
) -> None:
    """--task: what the --speculation prompts ask (see TASKS)."""
    if one_row:
        size, piece = one_row
        if speculation:
            print(json.dumps(speculation_row(str(bundle), size, task, answer, runs.split(","))))
        else:
            print(json.dumps(one(str(bundle), size, piece)))
        return
    if speculation:
        _compare_speculation(bundle, sizes, out, llama_cpp, task, answer, runs)
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


def _compare_speculation(
    bundle: Path,
    sizes: str,
    out: Path,
    llama_cpp: Path | None,
    task: str,
    answer: int,
    runs: str,
) -> None:
    rows = []
    for size in (int(n) for n in sizes.split(",")):
        command = [sys.executable, __file__, str(bundle), "--speculation", "--task", task]
        command += ["--answer", str(answer), "--runs", runs]
        command += ["--one", str(size), "0"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(
            f"{size} tokens: {rows[-1]['target']['decode_tokens_per_s']} / "
            f"{rows[-1].get('adaptive', {}).get('decode_tokens_per_s')} tok/s",
            flush=True,
        )
    llama = llama_rows(bundle, llama_cpp, rows)
    for row in rows:
        del row["prompt_ids"]  # thousands of ids a row: the sizes name the prompts
    command = "python benchmarks/long_context.py BUNDLE --speculation "
    command += f"--task {task} --answer {answer} --sizes {sizes}"
    command += "" if runs == ",".join(RUNS) else f" --runs {runs}"
    result = {
        "kind": "long_context",
        "mode": "speculation",
        "task": task,
        "answer": answer,
        "runs": ["target", *(r for r in runs.split(",") if r != "target")],
        "machine": machine.describe(),
        "command": command + (" --llama-cpp DIR" if llama else ""),
        "bundle": str(bundle),
        "rows": rows,
        "llama_server": llama,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
