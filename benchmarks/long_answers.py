"""The speculation rows of long_context.py (`--speculation`): the target alone, adaptive and
fixed K answering after one long prompt, or after one each for several requests at once
(`--clients`), round by round in turn (`--repeat` turns), with llama-server's rows beside; and
their reports.
long_context.py's docstring says what each option measures."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from long_context import ANSWER, CLIENT_OFFSET, RUNS, SOURCE, TASKS, source_text, task_prompt

from specrt import machine
from specrt.bundle import Bundle
from specrt.files import write_result
from specrt.tools import llamacpp, verdict

SCRIPT = str(Path(__file__).resolve().parent / "long_context.py")  # each size in a process


def speculation_row(
    bundle: str, size: int, task: str, answer: int, runs: list[str], repeat=1, clients=1
) -> dict:
    """One size, in this process: each run (the target alone, adaptive speculation reading the
    prompt whole or in its window, fixed:K) answering `answer` tokens after the same prompts
    (`clients` of them, each its own cut of the source, CLIENT_OFFSET tokens apart), each run in
    a runtime of its own over its own slots of one pair of engines (`_runtimes`). A warm-up pays
    the target alone's prefill (the row's first token) and copies it into the other runs' slots
    (`_share_prefill`; the prompt cache then holds the prompts there), then the runs take
    `repeat` turns, round by round in turn (`_interleaved`)."""
    from specrt.runtime.drafters import DRAFT_WINDOW

    order = ["target", *(r for r in runs if r != "target")]
    runtimes = _runtimes(bundle, order, clients)
    first = runtimes["target"]
    ids = first.tokenizer.encode(source_text())
    need = (clients - 1) * CLIENT_OFFSET + size
    if need > len(ids):
        raise SystemExit(
            f"{clients} client(s) of {size:,} tokens need {need:,} tokens of text, and "
            f"{SOURCE.name} has {len(ids):,}"
        )
    cuts = [ids[i * CLIENT_OFFSET : i * CLIENT_OFFSET + size] for i in range(clients)]
    prompts = [task_prompt(task, first.tokenizer.decode(cut)) for cut in cuts]
    encoded = [first.encode(p) for p in prompts]
    row = {"size": size, "prompt_ids": encoded, "prompt_tokens": len(encoded[0])}
    row.update(window=DRAFT_WINDOW, clients=clients, interleaved=True, shared_engines=True)
    options = {name: _options(name, rt) for name, rt in runtimes.items()}
    calibrated = {name: copy.deepcopy(rt.costs) for name, rt in runtimes.items()}
    row["priced"] = _priced(calibrated[order[0]], len(encoded[0]), clients)
    waited = {}
    for name, rt in runtimes.items():
        if name != "target":
            _share_prefill(first, rt)
        started = time.perf_counter()
        _run_alone(rt, prompts, 1, options[name])
        waited[name] = round(time.perf_counter() - started, 2)
    turns: dict[str, list[dict]] = {name: [] for name in order}
    for _ in range(repeat):
        for name, done in _interleaved(runtimes, calibrated, prompts, answer, options).items():
            turns[name].append(done)
    row |= {name: _mean(done) for name, done in turns.items()}
    row["target"]["ttft_s"] = waited["target"]
    return row


def _priced(calibrated, context: int, clients: int) -> dict[int, float]:
    """What calibration priced the call of K = 1 and 2 drafts a request at, over the call
    without drafts, after this prompt: the turns' outcome followed it after 4,000 tokens."""
    costs = copy.deepcopy(calibrated)
    costs.context = context
    one = costs.verify_cost(clients, clients)
    return {k: costs.verify_cost(clients * (k + 1), clients) / one for k in (1, 2)}


def _runtimes(bundle: str, order: list[str], clients: int) -> dict:
    """A runtime per run, each over `clients` slots of one pair of engines (`SlotRange`), all
    starting from one calibration of the costs at that many slots. Each run loaded its own
    engines before: where each copy of the weights lay in memory moved the draft model's calls
    by more than the runs differ (engines/slot_range.py), so a cell's ratio said which run was
    loaded first as much as what its policy did."""
    from specrt.engines.slot_range import split_slots
    from specrt.runtime import SpeculativeRuntime

    shared = SpeculativeRuntime.load(bundle, slots=clients * len(order), calibrate=False)
    drafts = split_slots(shared.draft, len(order))
    targets = split_slots(shared.target, len(order))
    runtimes = {
        name: SpeculativeRuntime(shared.bundle, draft, target)
        for name, draft, target in zip(order, drafts, targets, strict=True)
    }
    costs = runtimes[order[0]].calibrate()
    for rt in runtimes.values():
        rt.costs = copy.deepcopy(costs)
    return runtimes


def _share_prefill(source, rt) -> None:
    """Give another run's target slots what the target alone's hold after its warm-up, copied:
    the numbers that run's own prefill would compute (a position's keys and values depend on
    neither how calls are cut nor their neighbours, docs/batching.md), so a row pays one
    prefill where it paid one per run (4 minutes per 8,000-token prompt on 2 cores, 16 per run
    at 4 clients). Its warm-up then finds the prompts in the slots, as the target alone's
    turns do. A device cache has no host copy: each run there pays its own."""
    for slot in range(source.target.slots):
        held = source.target.held(slot)
        if not held:
            continue
        data = source.target.read_positions(slot, 0, len(held))
        if data is None:
            return
        rt.target.write_positions(slot, held, data)


def _options(name: str, rt) -> dict:
    """A run's request options: the target alone, adaptive with its draft model reading the
    prompt whole or without the scout, adaptive as served, or a controller (fixed:K)."""
    from specrt.runtime.drafters import make_drafter

    if name == "target":
        return {"speculate": False}
    if name == "whole":
        return {"drafter": make_drafter("model", rt.draft, window=None)}
    if name == "unscouted":
        return {"drafter": make_drafter("model", rt.draft, scout=False)}
    return {} if name == "adaptive" else {"controller": name}


def _seated(rt, prompts: list, answer: int, options: dict) -> tuple:
    """A scheduler of this runtime with the prompts added, each prompt fed whole, and their
    sequences."""
    from specrt.runtime import Scheduler

    scheduler = Scheduler(rt.target, rt.costs, slots=len(prompts), chunk=None)
    sequences = [rt.sequence(p, max_new_tokens=answer, ignore_eos=True, **options) for p in prompts]
    for sequence in sequences:
        scheduler.add(sequence)
    return scheduler, sequences


def _run_alone(rt, prompts: list, answer: int, options: dict) -> None:
    """The prompts at once in this runtime, to the end of their answers."""
    scheduler, _ = _seated(rt, prompts, answer, options)
    while scheduler.busy:
        scheduler.step()


def _interleaved(runtimes: dict, calibrated: dict, prompts: list, answer: int, options) -> dict:
    """One turn of every run, their rounds in turn (one round of each run, then the next), so
    that this machine's drift (10 % within a minute) falls on every run alike: run after run,
    a run 12 s long met the machine 19 % slower than the one before. Each run starts from its
    calibrated costs and empty draft slots (a run that found the last one's window there read
    it for free); its speed is its tokens after each request's first over the seconds of its
    own rounds (the prompts, in the slots, only set the first). A request alone starts from a
    fresh acceptance pool each turn (a pool that knew this text would set its course); a batch
    keeps its runtime's pool from turn to turn, as a server keeps it from batch to batch: a
    fresh one made every turn pay a cold server's warm-up (three rounds of drafts to learn
    acceptance, 1.7 s at 4 clients after 1,000 tokens, 0.95x the target alone, the rest of
    the turn within 1 % of it), where a server pays it once."""
    from specrt.runtime.pool import PooledAcceptance

    schedulers, sequences, seconds = {}, {}, dict.fromkeys(runtimes, 0.0)
    for name, rt in runtimes.items():
        rt.costs = copy.deepcopy(calibrated[name])
        if len(prompts) == 1:
            rt.acceptance = PooledAcceptance()
        for slot in range(rt.draft.slots):
            rt.draft.reset(slot)
        schedulers[name], sequences[name] = _seated(rt, prompts, answer, options[name])
    while any(s.busy for s in schedulers.values()):
        for name, scheduler in schedulers.items():
            if scheduler.busy:
                started = time.perf_counter()
                if scheduler.step().batch:
                    seconds[name] += time.perf_counter() - started
    return {name: _turn(done, seconds[name]) for name, done in sequences.items()}


def _turn(sequences: list, seconds: float) -> dict:
    """One run's turn: its speed, K and drafts, and each request's K, drafts kept and the
    controller's reason round by round, so that a cell's course (where adaptive stopped, why,
    when it came back) can be read from the JSON of a machine no longer at hand, not only
    from a trace run there."""
    stats = [s.result.stats for s in sequences]
    ks = [k for st in stats for k in st.ks]
    tokens = [s.result.token_ids for s in sequences]
    return {
        "decode_tokens_per_s": round(sum(st.new_tokens - 1 for st in stats) / seconds, 2),
        "mean_k": round(sum(ks) / max(1, len(ks)), 2),
        "accepted": sum(st.accepted for st in stats),
        "drafted": sum(st.drafted for st in stats),
        "tokens": tokens[0] if len(tokens) == 1 else tokens,
        "k_by_round": [st.ks for st in stats],
        "kept_by_round": [st.accepted_counts for st in stats],
        "reasons_by_round": [st.reasons for st in stats],
    }


def _mean(turns: list[dict]) -> dict:
    """A run's turns as one: mean decode speed and K, drafts summed, each turn's speed and K, and
    its output (one that differs from the first turn's, where any does, so that the table
    says so)."""
    tokens = next((t["tokens"] for t in turns if t["tokens"] != turns[0]["tokens"]), None)
    return {
        "decode_tokens_per_s": round(sum(t["decode_tokens_per_s"] for t in turns) / len(turns), 2),
        "mean_k": round(sum(t["mean_k"] for t in turns) / len(turns), 2),
        "accepted": sum(t["accepted"] for t in turns),
        "drafted": sum(t["drafted"] for t in turns),
        "turns": [t["decode_tokens_per_s"] for t in turns],
        "turn_ks": [t["mean_k"] for t in turns],
        "k_by_round": [t["k_by_round"] for t in turns],
        "kept_by_round": [t["kept_by_round"] for t in turns],
        "reasons_by_round": [t["reasons_by_round"] for t in turns],
        "tokens": tokens or turns[0]["tokens"],
    }


def llama_rows(bundle: Path, folder: Path | None, rows: list[dict], answer: int) -> dict | None:
    """llama-server on the same prompts' token ids, alone and with the draft GGUF, a slot for
    each request at once (None where no build or no GGUF is here)."""
    b = Bundle.load(bundle)
    binary, files = llamacpp.find_server(folder), llamacpp.gguf_sources(b)
    if binary is None or "target" not in files:
        print(llamacpp.MISSING if binary is None else "llama rows skipped: no target GGUF")
        return None
    threads, slots = machine.describe()["cores"], len(rows[0]["prompt_ids"])
    built = llamacpp.server_specs(b, binary, threads=threads, slots=slots)
    specs = {"draft" if spec.draft else "alone": spec for spec in built.values()}
    out: dict = {"commands": {}, "slots": slots}
    for name, spec in specs.items():
        out["commands"][name] = " ".join(spec.command(0))
        with llamacpp.serving(spec) as base:
            llamacpp.complete(base, rows[0]["prompt_ids"][0][:8], 4)  # warm-up
            for row in rows:
                row[f"llama_{name}"] = _llama_batch(base, row["prompt_ids"], answer)
                shown = {k: v for k, v in row[f"llama_{name}"].items() if k != "tokens"}
                print(f"llama-server {name}, {row['size']} tokens: {shown}", flush=True)
    return out


def _llama_batch(base: str, prompts: list[list[int]], answer: int) -> dict:
    """The prompts sent at once, a thread each. The batch's first token is its last request's
    first (every prompt read, as the target alone's row times it); its decode speed counts
    the tokens after each request's first that came while every request was decoding, over
    that span: llama-server reads a late prompt while the others decode, which slows them,
    where specrt's runs paid their prefill before. One request: its tokens after the first
    over their seconds."""
    start = time.perf_counter()

    def send(ids: list[int]) -> tuple[list[int], list[float]]:
        sent = time.perf_counter() - start
        tokens, times = llamacpp.complete(base, ids, answer)
        return tokens, [sent + t for t in times]

    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(send, prompts))
    first, last = max(t[0] for _, t in done), min(t[-1] for _, t in done)
    if last <= first:
        raise SystemExit(
            f"llama-server ended a request at {last:.1f} s, before the last "
            f"request's first token at {first:.1f} s: no span when all decode"
        )
    decoded = sum(first <= t <= last for _, times in done for t in times[1:])
    tokens = [t for t, _ in done]
    return {
        "ttft_s": round(first, 2),
        "decode_tokens_per_s": round(decoded / (last - first), 2),
        "tokens": tokens[0] if len(tokens) == 1 else tokens,
    }


def markdown(result: dict) -> str:
    if tuple(result.get("runs", RUNS)) != RUNS:
        return _runs_markdown(result)
    llama = result.get("llama_server") is not None
    lines = [
        "# Long prompts: what speculation gains after them",
        "",
        f"One request, greedy, {result.get('answer', ANSWER)} new tokens, the default draft "
        "and target; "
        f"{TASKS[result.get('task', 'chat')]}. {_turns(result)}(decode: tokens after the first "
        "over their rounds' seconds, the draft model's catch-up included; accepted: drafts the "
        f"target kept). `{result['command']}`",
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
    best fixed K (the goal: 0.97x at least), as the means' ratio and judged on the turns'
    spread (`specrt verdict`: holds, misses, or within noise)."""
    runs = [r for r in result["runs"] if r != "target"]
    lines = [
        "# Long prompts: what speculation gains after them",
        "",
        f"{_requests(result)}, greedy, {result['answer']} new tokens, the default draft and "
        f"target; {TASKS[result['task']]}. Each run: decode tok/s, mean K, drafts accepted. "
        f"{_turns(result)}`{result['command']}`",
        "",
        "| prompt tokens | target alone: first token, tok/s | "
        + " | ".join(runs)
        + " | adaptive / better of off and fixed | by turn (`specrt verdict`) | same output |",
        "|---" * (len(runs) + 5) + "|",
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
            f"{'–' if ratio is None else f'{ratio:.2f}×'} | "
            f"{verdict.brief(verdict.row_turns(row, result['runs']))} | {'yes' if same else 'NO'} |"
        )
    if result.get("llama_server") is not None:
        lines += ["", *_llama_markdown(result)]
    return "\n".join(lines) + "\n"


def _requests(result: dict) -> str:
    clients = result.get("clients", 1)
    if clients == 1:
        return "One request"
    return (
        f"{clients} requests at once, each after its own cut of the source ({CLIENT_OFFSET} "
        "tokens apart); speeds are the batch's"
    )


def _turns(result: dict) -> str:
    repeat = result.get("repeat", 1)
    if not result["rows"] or not result["rows"][0].get("interleaved"):  # whole runs in turn
        return "" if repeat == 1 else f"{repeat} turns of the runs, one after another. "
    each = f"; {repeat} turns, each cell's speed their mean, each turn's in brackets" * (repeat > 1)
    shared = " over its own slots of one pair of engines" * bool(
        result["rows"][0].get("shared_engines")
    )
    return (
        f"Each run in a runtime of its own{shared}, its prefill paid before; the runs answer "
        f"round by round in turn, so that the machine's drift falls on all alike{each}. "
    )


def _run_cell(run: dict | None) -> str:
    if run is None:
        return "–"
    kept = f"{run['accepted']}/{run['drafted']}" if "drafted" in run else "–"
    turns = run.get("turns", [])
    each = f" ({' '.join(f'{t:.1f}' for t in turns)})" if len(turns) > 1 else ""
    return f"{run['decode_tokens_per_s']:.2f}{each}, K {run['mean_k']:.1f}, {kept}"


def _slots(result: dict) -> str:
    slots = result["llama_server"].get("slots", 1)
    if slots == 1:
        return "one slot"
    return (
        f"{slots} slots, the {slots} prompts sent at once; its first token the batch's last "
        "request's, its decode speed over the span when all were decoding"
    )


def _llama_markdown(result: dict) -> list[str]:
    """specrt beside llama-server: speeds as ratios (above 1: specrt is faster)."""
    commands = result["llama_server"]["commands"]
    lines = [
        f"Beside llama-server on the same GGUF files and token ids ({_slots(result)}, "
        "`cache_prompt` off): the first token (specrt's target alone) and decode speed "
        "(specrt adaptive), each as specrt's speed over llama-server's. "
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
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the {size}-token row failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(
            f"{size} tokens: {rows[-1]['target']['decode_tokens_per_s']} / "
            f"{rows[-1].get('adaptive', {}).get('decode_tokens_per_s')} tok/s",
            flush=True,
        )
    llama = llama_rows(bundle, llama_cpp, rows, answer)
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
