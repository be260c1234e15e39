"""Build an engine bundle from a draft and a target model source.

Order matters for the user's time: the tokenizers are compared first (seconds), so a mismatched
pair is refused before minutes are spent exporting. Roles are written one after the other, each
one tensor at a time, so peak memory is a band of one tensor plus the export check's bounded
part of a model (check.CHECK_BYTES), whatever the model's size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specrt import __version__
from specrt.bundle import CACHE_MARGIN, FORMAT_VERSION, MANIFEST, ROLES, check_pair
from specrt.errors import SpecrtError
from specrt.exporter.batched_attention import GPU_FOLDER, GpuGraph
from specrt.exporter.check import (
    SAMPLE_TOKENS,
    check_graph,
    compare_converted,
    plan_subset,
    reference_logits,
    sample_ids,
)
from specrt.exporter.families import family_of
from specrt.exporter.graph import model_shape, write_graph
from specrt.exporter.precision import Precision, convert_float16
from specrt.exporter.projections import projections_for
from specrt.exporter.tensorrt import TrtOptions, build_engine, require_tensorrt
from specrt.exporter.tensors import open_weights
from specrt.files import atomic_dir, hash_tree, write_json_atomic
from specrt.machine import versions
from specrt.profiles import Profile, plan_profiles
from specrt.sources import Source, load_config, load_tokenizer

Log = Callable[[str], None]


@dataclass(frozen=True)
class _Plan:
    """What every role of one build shares."""

    max_context: int
    profiles: list[Profile]
    tensorrt: TrtOptions | None  # also compile a TensorRT engine per role
    gpu: GpuGraph | None  # also write a graph for ONNX Runtime's CUDA provider per role
    log: Log


def real_vocabulary(tokenizer) -> list[tuple[str, int]]:
    """(token, id) of a tokenizer, added tokens included, without the `[PAD<id>]` placeholders
    llama.cpp's converter appends to reach a model's padded logit count: Qwen2.5 0.5B's GGUF
    lists 151,936 tokens and 7B's 152,064 for one tokenizer of 151,665."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return [(token, i) for token, i in vocab if token != f"[PAD{i}]"]


def vocabulary_digest(tokenizer) -> str:
    """Identity of a tokenizer's vocabulary (see real_vocabulary)."""
    vocab = real_vocabulary(tokenizer)
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def eos_token_ids(source: Source, config, tokenizer) -> list[int]:
    """Every id that ends generation: generation config, model config and tokenizer all count."""
    ids: set[int] = set()
    for value in (_generation_eos(source), config.eos_token_id, tokenizer.eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(ids)


def _generation_eos(source: Source):
    """generation_config.json's eos_token_id, where the folder has one."""
    path = Path(source.spec) / "generation_config.json"
    if source.kind != "folder" or not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


def _versions() -> dict:
    found = versions(("torch", "transformers", "onnx", "onnxruntime", "gguf"))
    return {"specrt": __version__, **found}


FALLBACK_CONTEXT = 2048  # a model whose config names no context of its own


def build_bundle(
    draft: str | None,
    target: str,
    out: str | Path,
    *,
    max_draft: int = 8,
    max_lookup: int = 32,
    max_context: int | None = None,
    force: bool = False,
    precision: dict[str, Precision] | None = None,
    tensorrt: TrtOptions | None = None,
    gpu: GpuGraph | None = None,
    chat_template: str | None = None,
    log: Log = print,
) -> Path:
    """Export, check and write a bundle atomically; return its path.

    draft None builds a target-only bundle, which speculates by lookup (n-gram) alone.
    max_context None takes the models' own context (the smaller of the two; see _own_context:
    every slot can hold it, and a CPU slot's memory follows what it holds). precision maps a
    role to its weight precision (float32 where not given); tensorrt, when given, also compiles
    each role's graph into a TensorRT engine (and fails before any export where TensorRT or a
    GPU is missing); gpu, when given, also writes each role a graph with batched attention for
    ONNX Runtime's CUDA provider (batched_attention.py); chat_template: Jinja text stored in
    place of the target tokenizer's.
    """
    roles = [r for r in ROLES if r == "target" or draft is not None]
    precision = {role: (precision or {}).get(role, Precision()) for role in roles}
    _check_options(max_draft, max_lookup, precision, tensorrt)
    window = max(max_draft, max_lookup)  # the most drafts one verify call carries
    specs = {"draft": draft, "target": target}
    sources = {role: Source.parse(specs[role]) for role in roles}
    for role in roles:
        if precision[role].weights == "gguf" and sources[role].kind != "gguf":
            raise SpecrtError(
                f"--{role}-precision gguf keeps a GGUF file's own blocks, but {specs[role]} is "
                "not a GGUF file; pick int4 or int8 for other sources"
            )
    if max_context is None:
        max_context = min(map(_own_context, sources.values()))
    if max_context < window + 2:
        raise SpecrtError(f"--max-context {max_context} leaves no room for {window} drafts")
    plan = _Plan(max_context, plan_profiles(max_context, window), tensorrt, gpu, log)
    tokenizers, digests = _tokenizers(sources)
    out = Path(out)
    entries: dict[str, dict] = {}
    eos: dict[str, list[int]] = {}
    with atomic_dir(out, force=force) as tmp:
        for role in roles:
            where = (sources[role], tokenizers[role], digests[role], tmp / role)
            entries[role], eos[role] = _export_role(role, *where, precision[role], plan)
        manifest = {
            "format_version": FORMAT_VERSION,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
            "max_context": max_context,
            "max_draft": max_draft,
            "max_lookup": max_lookup,
            "kv_cache": {"positions": "per_row", "margin": CACHE_MARGIN, "layout": "by_position"},
            "profiles": {p.name: p.as_dict() for p in plan.profiles},
            "eos_token_ids": eos["target"],  # the target decides when text ends
            "chat_template": chat_template or tokenizers["target"].chat_template,
            "roles": entries,
        }
        check_pair(manifest)
        write_json_atomic(tmp / MANIFEST, manifest)
        log(f"writing bundle {out}")
    return out


def _own_context(source: Source) -> int:
    """The context a model was built for (max_position_embeddings), less the cache margin where
    its rotary covers only so many positions (longrope's original length)."""
    config = load_config(source)
    own = getattr(config, "max_position_embeddings", None) or FALLBACK_CONTEXT
    rotary = family_of(config).max_capacity()
    return own if rotary is None else min(own, rotary - CACHE_MARGIN)


def _tokenizers(sources: dict[str, Source]) -> tuple[dict, dict[str, str]]:
    """Each role's tokenizer and its vocabulary's digest; a pair must share one vocabulary."""
    tokenizers = {role: load_tokenizer(src) for role, src in sources.items()}
    digests = {role: vocabulary_digest(tok) for role, tok in tokenizers.items()}
    if len(set(digests.values())) > 1:
        raise SpecrtError(
            f"draft and target tokenizers differ ({len(tokenizers['draft'])} vs "
            f"{len(tokenizers['target'])} tokens, or different ids): speculation needs one "
            "shared vocabulary"
        )
    return tokenizers, digests


def _check_options(max_draft: int, max_lookup: int, precision: dict, tensorrt) -> None:
    """Refuse options out of range before anything is read (TensorRT: before any export)."""
    for flag, value in (("--max-draft", max_draft), ("--max-lookup", max_lookup)):
        if not 1 <= value < CACHE_MARGIN:
            raise SpecrtError(f"{flag} must be between 1 and {CACHE_MARGIN - 1}, got {value}")
    if tensorrt is not None:
        if any(p.weights != "fp32" for p in precision.values()):
            raise SpecrtError(
                "--backend tensorrt builds its engines from the float32 graphs (converted to "
                "--trt-precision); leave --draft-precision and --target-precision at fp32"
            )
        require_tensorrt()


def _export_role(
    role: str,
    source: Source,
    tokenizer,
    digest: str,
    folder: Path,
    precision: Precision,
    plan: _Plan,
) -> tuple[dict, list[int]]:
    """Export one role into folder; return its manifest entry and its end-of-sequence ids.

    The weights are read one tensor at a time, so memory holds a band of one tensor, not the
    model. Before the graph is written, the export check runs on a bounded part of the model
    (check.plan_subset): its float32 graph against transformers, and at a converted precision
    its converted graph against that float32 one.
    """
    started, log, max_context = time.perf_counter(), plan.log, plan.max_context
    log(f"[{role}] reading {source.spec}")
    tensors = open_weights(source)
    config = tensors.config
    limit = getattr(config, "max_position_embeddings", max_context)
    if max_context > limit:
        raise SpecrtError(f"{role}: --max-context {max_context} exceeds the model's {limit}")
    shape = model_shape(config)
    capacity = max_context + CACHE_MARGIN
    ids = sample_ids(tokenizer, shape.vocab_size, SAMPLE_TOKENS)
    check = _check(role, tensors, ids, folder.with_name(f"{role}.check"), precision, plan)
    log(
        f"[{role}] writing the ONNX graph ({config.model_type}, {shape.num_layers} layers, "
        f"{_label(precision)})"
    )
    record = _write_role_graph(tensors, folder, capacity, precision, log)
    gpu = None if plan.gpu is None else _write_gpu_graph(role, tensors, folder, capacity, plan)
    engine = None
    if plan.tensorrt is not None:
        log(f"[{role}] building the TensorRT engine ({plan.tensorrt.precision})")
        engine = build_engine(
            folder / "model.onnx",
            folder,
            plan.profiles,
            shape.as_dict(),
            max_context,
            plan.tensorrt,
            log,
        )
    tokenizer.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise SpecrtError(f"{source.spec}: the tokenizer has no tokenizer.json to ship")
    log(f"[{role}] hashing files")
    info = {
        "source": source.describe(),
        "shape": shape.as_dict(),
        "graph": "model.onnx",
        "precision": {**precision.as_dict(), **record},
        "tokenizer_sha256": digest,
        "tokenizer_ids": 1 + max(i for _, i in real_vocabulary(tokenizer)),
        "export_check": check,
        "export_seconds": round(time.perf_counter() - started, 2),
        "files": hash_tree(folder),
    }
    if engine is not None:
        info["tensorrt"] = engine
    if gpu is not None:
        info["gpu"] = gpu
    return info, eos_token_ids(source, config, tokenizer)


def _write_role_graph(tensors, folder: Path, capacity: int, precision: Precision, log) -> dict:
    """Write a role's graph into folder at its precision (fp16: the float32 graph, converted);
    return what the manifest records of its weights' forms."""
    projections = projections_for(precision)
    if precision.weights == "fp16":
        _write_float(tensors, folder, capacity, "fp16")
    else:
        folder.mkdir(parents=True)
        write_graph(tensors, folder, capacity, projections, precision.kv_cache)
    record = {"tensors": projections.forms} if precision.weights == "gguf" else {}
    if precision.quantized:
        record["embedding"] = projections.embedding_form
        log(f"  embedding: {projections.embedding_form}")
    for form, count in sorted(Counter(projections.forms.values()).items()):
        log(f"  {count} x {form}")
    return record


def _write_gpu_graph(role: str, tensors, folder: Path, capacity: int, plan: _Plan) -> dict:
    """The role's GPU graph (batched_attention.py) beside its CPU graph; its manifest entry."""
    gpu = plan.gpu
    plan.log(f"[{role}] writing the GPU graph ({gpu.precision}, {gpu.attention} attention)")
    _write_float(tensors, folder / GPU_FOLDER, capacity, gpu.precision, gpu.attention)
    return gpu.as_dict()


def _write_float(
    tensors, folder: Path, capacity: int, weights: str, attention: str = "in_place"
) -> None:
    """A float graph into folder: float32, or fp16 converted from the float32 one whole (its
    cache fp16 too)."""
    folder.mkdir(parents=True)
    if weights == "fp32":
        write_graph(tensors, folder, capacity, attention=attention)
        return
    float32 = folder.with_name(f"{folder.name}.fp32")
    float32.mkdir()
    write_graph(tensors, float32, capacity, attention=attention)
    convert_float16(float32 / "model.onnx", folder)
    shutil.rmtree(float32)


def _label(precision: Precision) -> str:
    """fp32, int4, ... and the cache where it is not float32: "int4, float16 cache"."""
    cache = precision.kv_cache
    return precision.weights + ("" if cache == "float32" else f", {cache} cache")


def _check(role: str, tensors, ids, scratch: Path, precision: Precision, plan: _Plan) -> dict:
    """The export check on check.plan_subset's part of the model, in scratch (then removed)."""
    log, capacity = plan.log, plan.max_context + CACHE_MARGIN
    subset, subset_ids = plan_subset(tensors, ids)
    whole = subset.layers == list(range(tensors.config.num_hidden_layers)) and subset.vocab is None
    part = (
        "the whole model"
        if whole
        else (
            f"layers {subset.layers} of {tensors.config.num_hidden_layers}"
            + ("" if subset.vocab is None else f", {len(subset.vocab)} token ids")
        )
    )
    log(f"[{role}] checking the graph against PyTorch on {part}")
    references = reference_logits(subset.as_stored(), subset_ids)
    scratch.mkdir(parents=True)
    try:
        (scratch / "fp32").mkdir()
        sub_shape = write_graph(subset, scratch / "fp32", capacity)
        check = check_graph(references, scratch / "fp32" / "model.onnx", sub_shape, subset_ids)
        del references
        check["checked_layers"] = subset.layers
        check["checked_vocabulary"] = sub_shape.vocab_size
        log(
            f"[{role}] max |logit difference| {check['max_abs_logit_diff']:.2e} "
            f"(tolerance {check['tolerance']:.2e})"
        )
        if plan.gpu is not None:
            check["gpu_graph_vs_float32"] = _check_gpu_graph(
                subset, scratch, sub_shape, subset_ids, plan, check["tolerance"]
            )
        if not precision.converted:
            return check
        (scratch / "converted").mkdir()
        if precision.weights == "fp16":
            convert_float16(scratch / "fp32" / "model.onnx", scratch / "converted")
        else:
            converted_projections = projections_for(precision)
            write_graph(
                subset, scratch / "converted", capacity, converted_projections, precision.kv_cache
            )
        converted = compare_converted(
            scratch / "fp32" / "model.onnx",
            scratch / "converted" / "model.onnx",
            sub_shape,
            subset_ids,
            capacity,
        )
        # A part of a model (layers skipped) magnifies conversion error: its KL is a check that
        # the converted graph works, not a measure of the model's quality (`specrt eval` is).
        if whole:
            check.update(converted)
        else:
            check["part_vs_float32"] = converted
        log(
            f"[{role}] {_label(precision)} vs float32 on {converted['sample_tokens']} tokens of "
            f"prose ({part}): KL mean {converted['kl_mean_vs_float32']:.4f}, top-1 agreement "
            f"{converted['top1_agreement_vs_float32']:.1%} (max |logit difference| "
            f"{converted['max_abs_logit_diff_vs_float32']:.2e})"
            + ("" if whole else "; `specrt eval` measures the whole model")
        )
        return check
    finally:
        shutil.rmtree(scratch)


def _check_gpu_graph(subset, scratch: Path, shape, ids, plan: _Plan, tolerance: float) -> dict:
    """The GPU graph of the checked part against its float32 CPU graph, run on the CPU (both
    attentions run there). An fp32 one must agree within the export check's tolerance, or the
    bundle is not written; an fp16 one's distance is recorded (precision.py's measures)."""
    capacity, gpu = plan.max_context + CACHE_MARGIN, plan.gpu
    _write_float(subset, scratch / "gpu", capacity, gpu.precision, gpu.attention)
    fp32, graph = scratch / "fp32" / "model.onnx", scratch / "gpu" / "model.onnx"
    result = compare_converted(fp32, graph, shape, ids, capacity)
    worst = result["max_abs_logit_diff_vs_float32"]
    plan.log(
        f"  GPU graph ({gpu.precision}, {gpu.attention}) vs float32: max |logit difference| "
        f"{worst:.2e}, top-1 agreement {result['top1_agreement_vs_float32']:.1%}"
    )
    if gpu.precision == "fp32" and worst > tolerance:
        raise SpecrtError(
            f"the fp32 GPU graph differs from the CPU graph by {worst:.2e} in a logit (tolerance "
            f"{tolerance:.2e}); the bundle was not written"
        )
    return result
