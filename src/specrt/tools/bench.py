"""`specrt bench`: every configuration on the same prompts, in one process, side by side.

This machine is shared and noisy, so only ratios measured in one run mean anything: the PyTorch
baseline, transformers' assisted generation, ONNX Runtime GenAI, and specrt's configurations on
one or more bundles (precision combinations) all run here, greedy, each after a warm-up, on the
same token ids. Every output is compared with the baseline's and with the target-alone output of
its own bundle (what it is lossless against), and mismatches are counted, not hidden. Each
bundle's verify-cost curve and the process's memory are recorded beside the speeds.

Per-token latency is charged as `per_token_latencies` says: a round's block of tokens shares the
time since the previous block.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrt import machine
from specrt.bundle import Bundle
from specrt.files import write_bytes_atomic, write_json_atomic
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import measure_costs
from specrt.runtime.sequence import per_token_latencies
from specrt.runtime.text import TextTokenizer
from specrt.tools import llamacpp
from specrt.tools.quality import recorded_quality

FIXED_KS = (1, 2, 4, 6, 8)
CURVE_TOKENS = 17  # verify costs are reported for K = 0..16 drafts, then to the lookup window
TARGET_ALONE = "specrt_target_only"
Log = Callable[[str], None]


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    ttft: float
    token_times: list[float]
    target_calls: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    prediction: tuple[int, int] | None = None  # prediction tokens accepted, rejected


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


def load_prompts(
    paths: Sequence[Path],
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[dict]:
    """JSONL files; each line has "prompt" (plain text), "messages" (chat), or Spec-Bench's
    "turns" (its first turn becomes a user message, through the chat template, as Spec-Bench
    runs it) with its "category". Lines without a category take their file's name. categories
    keeps only those; per_category keeps the first N of each, so a run fits in an hour here."""
    prompts, taken = [], {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if "turns" in item:
                item = {"messages": [{"role": "user", "content": item["turns"][0]}], **item}
            item.setdefault("set", Path(path).stem)
            item.setdefault("category", item["set"])
            category = item["category"]
            if categories and category not in categories:
                continue
            if per_category is not None and taken.get(category, 0) >= per_category:
                continue
            taken[category] = taken.get(category, 0) + 1
            prompts.append(item)
    return prompts


def prompt_input(item: dict) -> str | list[dict]:
    """What a loaded prompt line asks the model: its chat messages, else its plain text."""
    return item.get("messages") or item["prompt"]


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


class _TimingStreamer:
    """transformers streamer that timestamps every generated token (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times += [time.perf_counter() - self.start] * int(value.numel())

    def end(self) -> None:
        pass


def hf_runner(
    model, max_new_tokens: int, assistant=None, eos: list[int] | None = None
) -> Callable[[list[int]], Run]:
    """transformers generate, greedy; EOS ignored (as specrt's ignore_eos) for equal lengths
    unless eos lists the ids to stop at."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )

    def run(ids: list[int], _index: int | None = None) -> Run:
        streamer = _TimingStreamer()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                generation_config=config,
                assistant_model=assistant,
                streamer=streamer,
            )
        seconds = time.perf_counter() - streamer.start
        tokens = out[0, len(ids) :].tolist()
        return Run(
            tokens,
            seconds,
            streamer.times[0],
            streamer.times,
            target_calls=len(tokens) if assistant is None else None,
        )

    return run


def genai_runner(
    folder: Path, max_new_tokens: int, stop_at_eos: bool = False
) -> Callable[[list[int]], Run]:
    """ONNX Runtime GenAI's own loop (target alone, greedy). min_length pins the length, as
    ignore_eos does for the others (it differs only after an EOS, which the comparison shows),
    unless stop_at_eos."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(ids: list[int], _index: int | None = None) -> Run:
        params = og.GeneratorParams(model)
        total = len(ids) + max_new_tokens
        shortest = len(ids) + 1 if stop_at_eos else total
        params.set_search_options(max_length=total, min_length=shortest, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        tokens, times = [], []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            times.append(time.perf_counter() - start)
        return Run(tokens, times[-1], times[0], times, target_calls=len(tokens))

    return run


def specrt_runner(
    rt: SpeculativeRuntime,
    max_new_tokens: int,
    stop_at_eos=False,
    guesses: Sequence[str | None] = (),
    **options,
):
    """guesses: the prediction sent with each prompt (by its index), for prediction rows."""

    def run(ids: list[int], index: int | None = None) -> Run:
        guess = guesses[index] if guesses and index is not None else None
        result = rt.generate(
            ids,
            max_new_tokens=max_new_tokens,
            ignore_eos=not stop_at_eos,
            prediction=guess,
            **options,
        )
        s = result.stats
        return Run(
            result.token_ids,
            s.total_seconds,
            s.ttft_seconds,
            s.token_times,
            s.target_calls,
            s.drafted,
            s.accepted,
            (s.accepted_prediction_tokens, s.rejected_prediction_tokens) if guess else None,
        )

    return run


def llamacpp_runner(base: str, max_new_tokens: int, stop_at_eos: bool = False):
    """llama-server's greedy completion of the same token ids (EOS ignored unless
    stop_at_eos); its token times are when each streamed chunk arrived."""

    def run(ids: list[int], _index: int | None = None) -> Run:
        tokens, times = llamacpp.complete(base, ids, max_new_tokens, not stop_at_eos)
        return Run(tokens, times[-1], times[0], times)

    return run


def measure(name: str, runner, prompt_ids: list[list[int]], repeat: int, log: Log) -> tuple:
    runner(prompt_ids[0][:32])  # warm-up: first calls allocate and pick kernels
    runs, outputs = [], []
    for i, ids in enumerate(prompt_ids):
        for r in range(repeat):
            run = runner(ids, i)
            runs.append(run)
            if r == 0:
                outputs.append(run.token_ids)
            log(
                f"  {name:22} prompt {i + 1}/{len(prompt_ids)}  "
                f"{len(run.token_ids) / run.seconds:6.2f} tok/s"
            )
    return summarize(name, runs), outputs, runs


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


def specrt_configs(
    ks: Sequence[int] = FIXED_KS, suffix: str = "", has_draft: bool = True, predicted=False
) -> list[tuple[str, dict]]:
    """Target alone, then the draft model's rows (fixed K, heuristic, adaptive) where there is
    one, then the lookup's: n-gram alone and hybrid (n-gram when it matches, else the model),
    both under the adaptive policy; then, for prompts that carry a prediction, the prediction
    (the bundle's drafter where it has nothing) and another prompt's prediction (all wrong)."""
    configs = [(TARGET_ALONE, {"speculate": False})]
    if has_draft:
        configs += [(f"specrt_fixed_{k}", {"controller": f"fixed:{k}"}) for k in ks]
        configs += [
            ("specrt_heuristic", {"controller": "heuristic"}),
            ("specrt_adaptive", {"controller": "adaptive", "drafter": "model"}),
        ]
    configs.append(("specrt_ngram", {"controller": "adaptive", "drafter": "ngram"}))
    if has_draft:
        configs.append(("specrt_hybrid", {"controller": "adaptive", "drafter": "hybrid"}))
    if predicted:
        configs.append(("specrt_predicted", {"controller": "adaptive", "guess": "own"}))
        configs.append(("specrt_wrong_prediction", {"controller": "adaptive", "guess": "other"}))
    return [(name + suffix, options) for name, options in configs]


def genai_row_name(label: str) -> str:
    """`ort_genai` for an unlabelled GenAI model, `ort_genai_int4` for one labelled int4."""
    return "ort_genai" if not label else f"ort_genai_{label}"


def run_bench(
    bundle_paths: Path | Sequence[Path],
    prompts: list[dict],
    *,
    max_new_tokens: int = 128,
    repeat: int = 1,
    only: Sequence[str] | None = None,
    threads: int | None = None,
    genai_models: dict[str, Path] | None = None,
    stop_at_eos: bool = False,
    llama_cpp: str | Path | None = None,
    llama_drafts: tuple[int, ...] | None = None,
    log: Log = print,
) -> dict:
    """Baselines from the first bundle's recorded sources, then specrt rows for every bundle.

    Rows of a bundle that is not float32 throughout carry its precision label as a suffix
    (specrt_adaptive_d-int4_t-fp32); genai_models maps a label ("" or "int4") to a model folder.
    Every row ignores EOS and generates max_new_tokens, unless stop_at_eos: then each stops
    where the model ends its answer (as Spec-Bench runs), and greedy rows still match token for
    token, so their lengths agree. llama.cpp's rows (`llama_cpp`: where llama-server is; see
    llamacpp.py) run the GGUF files the first GGUF-built bundle came from, its draft rows at
    each of `llama_drafts` drafted tokens (default: the bundle's K_max), and its n-gram lookup.
    """
    paths = [Path(bundle_paths)] if isinstance(bundle_paths, str | Path) else list(bundle_paths)
    bundles = [Bundle.load(path) for path in paths]
    tokenizer = TextTokenizer.from_bundle(bundles[0])
    prompt_ids = [tokenizer.encode_prompt(prompt_input(p)) for p in prompts]
    wanted = (lambda name: name in only) if only else (lambda name: True)
    own = [p.get("prediction") for p in prompts]
    guesses = {"own": own, "other": own[1:] + own[:1]}  # "other": another prompt's, all wrong
    rows, outputs, notes, costs, padding = [], {}, [], {}, {}

    categories = [p["category"] for p in prompts]

    def record(name, runner, exact_against=None):
        log(f"{name}:")
        row, outs, runs = measure(name, runner, prompt_ids, repeat, log)
        row.exact_against, row.rss_mb = exact_against, current_rss_mb()
        row.categories = by_category(runs, categories, repeat)
        rows.append(row)
        outputs[name] = outs

    # One framework's copy of the models in memory at a time: PyTorch, then GenAI, then specrt.
    if wanted("pytorch_baseline") or wanted("hf_assisted"):
        eos = bundles[0].eos_token_ids if stop_at_eos else None
        _torch_rows(bundles[0], max_new_tokens, threads, wanted, record, eos)
        gc.collect()
    for label, folder in (genai_models or {"": None}).items():
        name = genai_row_name(label)
        if wanted(name):
            note = _genai_missing(name, folder)
            if note:
                notes.append(note)
            else:
                record(name, genai_runner(folder, max_new_tokens, stop_at_eos))
                gc.collect()
    notes += _llamacpp_rows(
        bundles, llama_cpp, llama_drafts, max_new_tokens, threads, stop_at_eos, wanted, record
    )
    for bundle in bundles:
        label = bundle.precision_label
        suffix = "" if label == "d-fp32_t-fp32" else f"_{label}"
        every = specrt_configs(bundle_ks(bundle), suffix, bundle.has_draft, any(own))
        configs = [(n, o) for n, o in every if wanted(n)]
        if not configs:
            continue
        rt = SpeculativeRuntime.load(
            bundle.path, threads=threads, calibrate=False, prompt_cache=False
        )
        costs[label] = cost_report(rt)
        padding[label] = row_padding(rt)
        for name, options in configs:
            options = dict(options)
            chosen = guesses[options.pop("guess")] if "guess" in options else ()
            runner = specrt_runner(rt, max_new_tokens, stop_at_eos, chosen, **options)
            record(name, runner, TARGET_ALONE + suffix)
        del rt
        gc.collect()
    _compare(rows, outputs)
    return {
        "kind": "bench",
        "bundle": str(paths[0]),
        "bundles": {b.precision_label: str(b.path) for b in bundles},
        "machine": machine.describe(threads),
        "settings": {
            "max_new_tokens": max_new_tokens,
            "stop_at_eos": stop_at_eos,
            "repeat": repeat,
            "greedy": True,
            "prompts": len(prompts),
            "precisions": [b.precision_label for b in bundles],
            "prompt_sets": sorted({p["set"] for p in prompts}),
            "categories": sorted(set(categories)),
        },
        "configs": [asdict(r) for r in rows],
        "costs": costs,
        "row_padding": padding,
        "quality": {b.precision_label: recorded_quality(b) for b in bundles},
        "peak_rss_mb": peak_rss_mb(),
        "notes": notes,
    }


def _llamacpp_rows(bundles, hint, drafts, max_new_tokens, threads, stop_at_eos, wanted, record):
    """llama-server alone, with the draft GGUF (at each of `drafts` drafted tokens; default
    the bundle's K_max) and with its n-gram lookup (beside specrt's n-gram rows), one server at
    a time; returns the notes of what was skipped and why."""
    built = [b for b in bundles if "target" in llamacpp.gguf_sources(b)]
    if not built:
        return ["llama.cpp rows skipped: no bundle built from GGUF files on disk"]
    if not any(wanted(name) for name in llamacpp.row_names(built[0], drafts, lookup=True)):
        return []
    binary = llamacpp.find_server(hint)
    if binary is None:
        return [llamacpp.MISSING]
    for name, spec in llamacpp.server_specs(built[0], binary, drafts, threads, lookup=True).items():
        if wanted(name):
            with llamacpp.serving(spec) as base:
                record(name, llamacpp_runner(base, max_new_tokens, stop_at_eos))
    return []


def cost_report(rt: SpeculativeRuntime) -> dict:
    """The draft step and the target's verify curve after a 48-token prefix, K = 0..16 drafts,
    then a few windows up to the bundle's lookup window (beyond its K_max only where its context
    allows), in ms and relative to K = 0.

    The same measurement calibrates the runtime, so the bench measures the curve once."""
    room = rt.target.capacity - 48
    k_max, window = min(CURVE_TOKENS, room) - 1, min(rt.bundle.max_lookup, room - 1)
    rt.costs = measure_costs(rt.draft, rt.target, k_max, repeats=3, k_lookup=window)
    curve, draft = rt.costs.curve(), rt.costs.draft_step
    one = curve[1]
    return {
        "draft_step_ms": None if draft is None else 1000 * draft,  # None: no draft model
        "verify_ms": {n: 1000 * t for n, t in curve.items()},
        "verify_ratio": {n: t / one for n, t in curve.items()},
        "draft_over_verify": None if draft is None else draft / one,
    }


def row_padding(rt: SpeculativeRuntime) -> dict | None:
    """What the target's row probe found on this machine (None: not probed, e.g. the torch
    or TensorRT backends), so a result says whether its calls were padded to even rows."""
    probe = getattr(rt.target, "row_probe", None)
    return None if probe is None else probe.as_dict()


def current_rss_mb() -> float:
    """Resident memory now (Linux /proc; 0 where it is not available)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def bundle_ks(bundle: Bundle) -> list[int]:
    return [k for k in FIXED_KS if k <= bundle.max_draft]


def _torch_rows(bundle: Bundle, max_new_tokens, threads, wanted, record, eos=None) -> None:
    """The transformers rows, on the bundle's recorded (and re-hashed) source weights."""
    from specrt.engines.torch import TorchEngine

    target = TorchEngine.from_bundle(bundle, "target", threads=threads).model
    if wanted("pytorch_baseline"):
        record("pytorch_baseline", hf_runner(target, max_new_tokens, eos=eos))
    if wanted("hf_assisted") and bundle.has_draft:
        draft = TorchEngine.from_bundle(bundle, "draft", threads=threads).model
        record("hf_assisted", hf_runner(target, max_new_tokens, assistant=draft, eos=eos))


def _genai_missing(name: str, folder: Path | None) -> str | None:
    """Why an ONNX Runtime GenAI row cannot run, or None when it can."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return f"{name} skipped: onnxruntime-genai is not installed"
    if folder is None:
        return (
            f"{name} skipped: pass --genai-model [LABEL=]DIR (a model built by "
            "`python -m onnxruntime_genai.models.builder` from the same float32 target)"
        )
    return None


def _compare(rows: list[Row], outputs: dict) -> None:
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
    result: dict, out: Path, stem: str, log: Log = print, render=None, draw=None
) -> list[Path]:
    """JSON, a Markdown table and a PNG chart (without matplotlib, the bench extra, the chart
    is skipped with a line saying so); returns the paths written. render and draw make the
    table and the chart (default: this module's, for `specrt bench` results)."""
    render, draw = render or markdown, draw or chart
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
