"""The speculation rows of long_context.py (`--speculation`): the target alone, adaptive and
fixed K answering after one long prompt, or after one each for several requests at once
(`--clients`), in turns (`--repeat`), with llama-server's rows beside; and their reports.
long_context.py's docstring says what each option measures."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from long_context import ANSWER, CLIENT_OFFSET, RUNS, TASKS, source_text, task_prompt

from specrt import machine
from specrt.bundle import Bundle
from specrt.files import write_result
from specrt.tools import llamacpp

SCRIPT = str(Path(__file__).resolve().parent / "long_context.py")  # each size in a process


def speculation_row(
    bundle: str, size: int, task: str, answer: int, runs: list[str], repeat=1, clients=1
) -> dict:
    """One size, in this process: each run (the target alone, adaptive speculation reading the
    prompt whole or in its window, fixed:K) answering `answer` tokens after the same prompt
    (the speculating runs from the target alone's prefix in the slot), in turns (`_turns_of`)."""
    from specrt.runtime import SpeculativeRuntime
    from specrt.runtime.drafters import DRAFT_WINDOW, make_drafter

    rt = SpeculativeRuntime.load(bundle, slots=clients)
    calibrated = copy.deepcopy(rt.costs)
    text = rt.tokenizer.decode(rt.tokenizer.encode(source_text())[:size])
    prompt = task_prompt(task, text)
    ids = rt.encode(prompt)
    row = {"size": size, "prompt_ids": ids, "prompt_tokens": len(ids), "window": DRAFT_WINDOW}
    if clients > 1:
        return _clients_row(rt, calibrated, row, task, answer, runs, repeat, clients)
    known = {
        "target": {"speculate": False},
        "whole": {"drafter": make_drafter("model", rt.draft, window=None)},
        "unscouted": {"drafter": make_drafter("model", rt.draft, scout=False)},
        "adaptive": {},
    }

    def turn(name: str) -> dict:
        options = known.get(name) or {"controller": name}
        result = rt.generate(prompt, max_new_tokens=answer, ignore_eos=True, **options)
        s = result.stats
        decode = (s.new_tokens - 1) / (s.total_seconds - s.ttft_seconds)
        return {
            "ttft_s": round(s.ttft_seconds, 2),
            "decode_tokens_per_s": round(decode, 2),
            "mean_k": round(sum(s.ks) / max(1, len(s.ks)), 2),
            "accepted": s.accepted,
            "drafted": s.drafted,
            "tokens": result.token_ids,
        }

    return row | _turns_of(rt, calibrated, runs, repeat, turn)


def _clients_row(rt, calibrated, row: dict, task: str, answer: int, runs, repeat, clients):
    """`clients` requests at once, each after its own cut of the source (CLIENT_OFFSET tokens
    apart), through one scheduler of as many slots: a warm-up pays their prefill (the prompt
    cache then holds each prompt in its slot), then the runs' turns as in `speculation_row`,
    each run's speed the batch's (tokens after each request's first, over the seconds from the
    first request's first token to the last one's end)."""
    ids = rt.tokenizer.encode(source_text())
    size = row["size"]
    cuts = [ids[i * CLIENT_OFFSET : i * CLIENT_OFFSET + size] for i in range(clients)]
    prompts = [task_prompt(task, rt.tokenizer.decode(cut)) for cut in cuts]
    start = time.perf_counter()
    _batch_turn(rt, prompts, 1, {"speculate": False})
    row.update(clients=clients, prefill_s=round(time.perf_counter() - start, 1))

    def turn(name: str) -> dict:
        options = {"speculate": False} if name == "target" else {"controller": name}
        return _batch_turn(rt, prompts, answer, options)

    return row | _turns_of(rt, calibrated, runs, repeat, turn)


def _turns_of(rt, calibrated, runs: list[str], repeat: int, turn) -> dict:
    """Each run (the target alone first: it pays the prefill) `repeat` times, the runs taking
    turns, since this machine's speed drifts by 10 % within a minute; each turn from the
    calibrated costs, a fresh acceptance pool and empty draft slots (a run that found the last
    one's window there read it for free). Returns each run's turns as one (`_mean`)."""
    from specrt.runtime.pool import PooledAcceptance

    order = ["target", *(r for r in runs if r != "target")]
    turns: dict[str, list[dict]] = {name: [] for name in order}
    for _ in range(repeat):
        for name in order:
            rt.costs, rt.acceptance = copy.deepcopy(calibrated), PooledAcceptance()
            for slot in range(rt.draft.slots):
                rt.draft.reset(slot)
            turns[name].append(turn(name))
    return {name: _mean(done) for name, done in turns.items()}


def _batch_turn(rt, prompts: list, answer: int, options: dict) -> dict:
    from specrt.runtime import Scheduler

    scheduler = Scheduler(rt.target, rt.costs, slots=len(prompts))
    sequences = [rt.sequence(p, max_new_tokens=answer, ignore_eos=True, **options) for p in prompts]
    for sequence in sequences:
        scheduler.add(sequence)
    first, begun = None, time.perf_counter()
    while any(s.result is None for s in sequences):
        scheduler.step()
        if first is None and any(s.produced for s in sequences):
            first = time.perf_counter()
    stats = [s.result.stats for s in sequences]
    ks = [k for st in stats for k in st.ks]
    return {
        "ttft_s": round(first - begun, 2),
        "decode_tokens_per_s": round(
            sum(st.new_tokens - 1 for st in stats) / (time.perf_counter() - first), 2
        ),
        "mean_k": round(sum(ks) / max(1, len(ks)), 2),
        "accepted": sum(st.accepted for st in stats),
        "drafted": sum(st.drafted for st in stats),
        "tokens": [s.result.token_ids for s in sequences],
    }


def _mean(turns: list[dict]) -> dict:
    """A run's turns as one: the first's time to first token (the target alone's prefill),
    mean decode speed and K, drafts summed, each turn's speed, and its output (one that differs
    from the first turn's, where any does, so that the table says so)."""
    tokens = next((t["tokens"] for t in turns if t["tokens"] != turns[0]["tokens"]), None)
    return {
        "ttft_s": turns[0]["ttft_s"],
        "decode_tokens_per_s": round(sum(t["decode_tokens_per_s"] for t in turns) / len(turns), 2),
        "mean_k": round(sum(t["mean_k"] for t in turns) / len(turns), 2),
        "accepted": sum(t["accepted"] for t in turns),
        "drafted": sum(t["drafted"] for t in turns),
        "turns": [t["decode_tokens_per_s"] for t in turns],
        "tokens": tokens or turns[0]["tokens"],
    }


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
        f"{_requests(result)}, greedy, {result['answer']} new tokens, the default draft and "
        f"target; {TASKS[result['task']]}. Each run: decode tok/s, mean K, drafts accepted; the "
        f"speculating runs start from the target alone's prefix in the slot. {_turns(result)}"
        f"`{result['command']}`",
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
            f"{_run_cell(alone).split(', K')[0]} | {cells} | "
            f"{'–' if ratio is None else f'{ratio:.2f}×'} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _requests(result: dict) -> str:
    clients = result.get("clients", 1)
    if clients == 1:
        return "One request"
    return (
        f"{clients} requests at once, each after its own cut of the source ({CLIENT_OFFSET} "
        "tokens apart), their prefill paid before the runs; speeds are the batch's"
    )


def _turns(result: dict) -> str:
    repeat = result.get("repeat", 1)
    if repeat == 1:
        return ""
    return (
        f"The runs took {repeat} turns in turn, in one process: each cell's speed is their "
        "mean, each turn's in brackets (the drafts summed). "
    )


def _run_cell(run: dict | None) -> str:
    if run is None:
        return "–"
    kept = f"{run['accepted']}/{run['drafted']}" if "drafted" in run else "–"
    turns = run.get("turns", [])
    each = f" ({' '.join(f'{t:.1f}' for t in turns)})" if len(turns) > 1 else ""
    return f"{run['decode_tokens_per_s']:.2f}{each}, K {run['mean_k']:.1f}, {kept}"


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


def compare(
    bundle: Path,
    sizes: str,
    out: Path,
    llama_cpp: Path | None,
    task: str,
    answer: int,
    runs: str,
    repeat: int,
    clients: int,
) -> None:
    rows = []
    for size in (int(n) for n in sizes.split(",")):
        command = [sys.executable, SCRIPT, str(bundle), "--speculation", "--task", task]
        command += ["--answer", str(answer), "--runs", runs, "--repeat", str(repeat)]
        command += ["--clients", str(clients)]
        command += ["--one", str(size), "0"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(
            f"{size} tokens: {rows[-1]['target']['decode_tokens_per_s']} / "
            f"{rows[-1].get('adaptive', {}).get('decode_tokens_per_s')} tok/s",
            flush=True,
        )
    llama = llama_rows(bundle, llama_cpp, rows) if clients == 1 else None
    for row in rows:
        del row["prompt_ids"]  # thousands of ids a row: the sizes name the prompts
    command = "python benchmarks/long_context.py BUNDLE --speculation "
    command += f"--task {task} --answer {answer} --sizes {sizes}"
    command += "" if runs == ",".join(RUNS) else f" --runs {runs}"
    command += "" if repeat == 1 else f" --repeat {repeat}"
    command += "" if clients == 1 else f" --clients {clients}"
    result = {
        "kind": "long_context",
        "mode": "speculation",
        "task": task,
        "answer": answer,
        "repeat": repeat,
        "clients": clients,
        "runs": ["target", *(r for r in runs.split(",") if r != "target")],
        "machine": machine.describe(),
        "command": command + (" --llama-cpp DIR" if llama else ""),
        "bundle": str(bundle),
        "rows": rows,
        "llama_server": llama,
    }
    write_result(out, result, markdown(result))
    print(markdown(result))
