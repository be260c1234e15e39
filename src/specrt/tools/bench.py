"""`specrt bench`: every configuration on the same prompts, in one process, side by side.

This machine is shared and noisy, so only ratios measured in one run mean anything: the PyTorch
baseline, transformers' assisted generation, ONNX Runtime GenAI, and specrt's configurations on
one or more bundles (precision combinations) all run here, greedy, each after a warm-up, on the
same token ids. Every output is compared with the baseline's and with the target-alone output of
its own bundle (what it is lossless against), and mismatches are counted, not hidden. Each
bundle's verify-cost curve and the process's memory are recorded beside the speeds. The
runners are runners.py's, the rows and the report report.py's, the chart charts.py's.
"""

from __future__ import annotations

import gc
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from specrt import machine
from specrt.bundle import Bundle
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import measure_costs
from specrt.runtime.text import TextTokenizer
from specrt.tools import llamacpp
from specrt.tools.prompts import prompt_input
from specrt.tools.quality import recorded_quality
from specrt.tools.report import by_category, compare_rows, summarize
from specrt.tools.runners import genai_runner, hf_runner, llamacpp_runner, specrt_runner

FIXED_KS = (1, 2, 4, 6, 8)
CURVE_TOKENS = 17  # verify costs are reported for K = 0..16 drafts, then to the lookup window
TARGET_ALONE = "specrt_target_only"
Log = Callable[[str], None]


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
    rows, outputs, notes = [], {}, []
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
    notes += _genai_rows(genai_models, max_new_tokens, stop_at_eos, wanted, record)
    notes += _llamacpp_rows(
        bundles, llama_cpp, llama_drafts, max_new_tokens, threads, stop_at_eos, wanted, record
    )
    costs, padding = _specrt_rows(
        bundles, max_new_tokens, threads, stop_at_eos, wanted, record, guesses
    )
    compare_rows(rows, outputs)
    settings = {"max_new_tokens": max_new_tokens, "stop_at_eos": stop_at_eos, "repeat": repeat}
    return {
        "kind": "bench",
        "bundle": str(paths[0]),
        "bundles": {b.precision_label: str(b.path) for b in bundles},
        "machine": machine.describe(threads),
        "settings": {**settings, **_run_settings(bundles, prompts)},
        "configs": [asdict(r) for r in rows],
        "costs": costs,
        "row_padding": padding,
        "quality": {b.precision_label: recorded_quality(b) for b in bundles},
        "peak_rss_mb": peak_rss_mb(),
        "notes": notes,
    }


def _run_settings(bundles: list[Bundle], prompts: list[dict]) -> dict:
    """What a run's rows share besides its options: greedy, its prompts and precisions."""
    return {
        "greedy": True,
        "prompts": len(prompts),
        "precisions": [b.precision_label for b in bundles],
        "prompt_sets": sorted({p["set"] for p in prompts}),
        "categories": sorted({p["category"] for p in prompts}),
    }


def _genai_rows(genai_models, max_new_tokens, stop_at_eos, wanted, record) -> list[str]:
    """ONNX Runtime GenAI's rows, one per model folder given; notes where one is missing."""
    notes = []
    for label, folder in (genai_models or {"": None}).items():
        name = genai_row_name(label)
        if not wanted(name):
            continue
        note = _genai_missing(name, folder)
        if note:
            notes.append(note)
            continue
        record(name, genai_runner(folder, max_new_tokens, stop_at_eos))
        gc.collect()
    return notes


def _specrt_rows(bundles, max_new_tokens, threads, stop_at_eos, wanted, record, guesses):
    """Each bundle's specrt rows, one runtime in memory at a time; returns each bundle's
    measured costs and row padding, by precision label."""
    costs, padding = {}, {}
    for bundle in bundles:
        label = bundle.precision_label
        suffix = "" if label == "d-fp32_t-fp32" else f"_{label}"
        every = specrt_configs(bundle_ks(bundle), suffix, bundle.has_draft, any(guesses["own"]))
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
    return costs, padding


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
