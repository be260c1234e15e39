"""Check an exported graph before a bundle is written: against PyTorch, and after a precision
conversion against the float32 graph it came from.

Greedy speculation promises the target's own tokens, so a float32 graph that drifts from its
source is refused at build time rather than discovered in production. A converted graph differs
on purpose; its difference is measured and recorded (what `inspect` shows), and only a broken one
(non-finite logits) is refused. Both checks drive the graph exactly as the runtime will: a
prefill, then 1 token and then several on top of the cache, over real text (the package's prose
sample): on random tokens every model is lost, and agreement there says little.

The check must fit the build's memory bound whatever the model's size, so it runs on a part of
the model (plan_subset): the whole of a small one; of a larger one, its first layers and its
last and, where the tables are large, some of its vocabulary, written by the same graph writer
from the same weights. transformers' reference runs first and is freed before ONNX Runtime
loads the graph. What the part cannot show (a converted model's KL over all its layers) is what
`specrt eval` measures on the finished bundle.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.agreement import PROSE, Comparison
from specrt.exporter.graph import ModelShape
from specrt.exporter.tensors import Subset, Tensors

# Max |ORT logit - PyTorch logit| allowed, relative to the largest |logit| (float32 graphs).
# Measured: ~2e-6 relative on the tiny models; summation order alone stays far below this, while a
# wrong rotary, mask or cache position shows up as an error of order 1.
RELATIVE_TOLERANCE = 1e-3
STEPS = (("prefill", 12), ("decode", 1), ("verify", 5))
# A converted graph is compared over more text, for a KL divergence and top-1 agreement that mean
# something (`specrt eval` measures more, on longer texts).
CONVERTED_STEPS = (("prefill", 120), ("decode", 1), ("verify", 7))
SAMPLE_TOKENS = sum(n for _, n in CONVERTED_STEPS)  # the longer of the two
# float32 bytes of weights the check runs at once (transformers', then ONNX Runtime's copy): the
# build's memory bound. 0.5B models and up are checked on a subset (see plan_subset).
CHECK_BYTES = 768 * 2**20
CHECK_VOCAB = 8192
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def converted_steps(positions: int) -> tuple[tuple[str, int], ...]:
    """CONVERTED_STEPS, with a shorter prefill where the graph covers fewer positions."""
    (_, prefill), *rest = CONVERTED_STEPS
    return (("prefill", min(prefill, positions - SAMPLE_TOKENS + prefill)), *rest)


def sample_ids(tokenizer, vocab_size: int, count: int) -> np.ndarray:
    """The first count tokens of the prose sample, [1, count] (ids past the model's vocabulary,
    which only a mismatched tokenizer has, are left out)."""
    ids = [i for i in tokenizer(PROSE.read_text(encoding="utf-8"))["input_ids"] if i < vocab_size]
    if len(ids) < count:
        raise SpecrtError(f"the prose sample gives {len(ids)} tokens, the check needs {count}")
    return np.asarray(ids[:count], dtype=np.int64)[None]


def _steps(
    graph: Path, shape: ModelShape, ids: np.ndarray, steps=STEPS, wider: int = 0
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield (case name, new token ids, float32 logits) for each step, the cache carried over.
    Each call's cache is bound at exactly its length, as the engine binds a lone row: the path
    the graph's attention takes to read it in place (exporter/attention.py); `wider` positions
    more send it down the row-by-row path instead (what a batch bound without its row views
    takes)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # not a warning for each row view (engines/onnxruntime.py)
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    # The positions' axis: 1 by position, 2 by head (a batched graph, which attends over its
    # caches whole and reads a mask as wide as they are).
    axis = 2 if caches[0].shape[2] == "positions" else 1
    empty = [1, shape.num_kv_heads, shape.head_dim]
    empty.insert(axis, 0)
    cache = {i.name: np.zeros(empty, ORT_DTYPES[i.type]) for i in caches}
    output_names = [o.name for o in session.get_outputs()]
    position = 0
    for name, count in steps:
        new = ids[:, position : position + count]
        pads = [(0, 0)] * 4
        pads[axis] = (0, count + wider)
        grown = {k: np.pad(v, pads) for k, v in cache.items()}
        width = position + count + (wider if axis == 2 else 0)
        outputs = session.run(
            None,
            {
                "input_ids": new,
                "attention_mask": np.ones((1, width), np.int64),
                "position_ids": np.arange(position, position + count)[None],
                "logits_to_keep": np.array([count]),
                **grown,
            },
        )
        for out_name, value in zip(output_names[1:], outputs[1:], strict=True):
            kept = np.take(value, np.arange(position + count), axis=axis)
            cache[out_name.replace("present", "past_key_values")] = kept
        yield f"{name}_{count}", new, outputs[0].astype(np.float32)
        position += count


def plan_subset(tensors: Tensors, ids: np.ndarray) -> tuple[Subset, np.ndarray]:
    """The part of the model the export check runs, and the sample's ids in its vocabulary.

    A model whose float32 weights fit CHECK_BYTES is checked whole. A larger one is checked on
    its first layers and its last (as many as fit, at least one) and, where the embedding and
    head alone would not fit, on the first CHECK_VOCAB token ids plus every id of the sample:
    each op the graph writer emits still runs on the model's own weights, so a wrong rotary,
    mask, cache position, norm or head shows up as it would on the whole model."""
    config = tensors.config
    layers = config.num_hidden_layers
    embed = "model.embed_tokens.weight"
    per_layer = 4 * sum(
        math.prod(tensors.shape(n)) for n in tensors.names() if n.startswith("model.layers.0.")
    )
    vocab_rows, hidden = tensors.shape(embed)
    tables = 1 if "lm_head.weight" not in tensors else 2
    table_bytes = 4 * vocab_rows * hidden * tables
    vocab = None
    if table_bytes > CHECK_BYTES // 2:
        vocab = np.union1d(np.arange(min(vocab_rows, CHECK_VOCAB)), ids.ravel())
        table_bytes = 4 * len(vocab) * hidden * tables
        ids = np.searchsorted(vocab, ids)
    fit = max(1, min(layers, (CHECK_BYTES - table_bytes) // max(1, per_layer)))
    chosen = list(range(layers)) if fit >= layers else [*range(fit - 1), layers - 1]
    return Subset(tensors, chosen if fit > 1 else [0], vocab), ids


def reference_logits(tensors: Tensors, ids: np.ndarray) -> list[np.ndarray]:
    """transformers' own forward over the same weights, step by step as _steps drives the
    graph; the model is freed before the graph is run, so the two are never in memory at once."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_config(tensors.config, dtype=torch.float32).eval()
    tied = getattr(tensors.config, "tie_word_embeddings", False)
    missing = []
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in tensors:
                param.copy_(torch.tensor(tensors.get(name)))  # a copy: GGUF floats are read-only
            elif not (tied and name == "lm_head.weight"):
                missing.append(name)
    if missing:
        raise SpecrtError(f"{tensors}: the weights lack {', '.join(missing[:5])}")
    cache, outputs, position = DynamicCache(config=model.config), [], 0
    for _, count in STEPS:
        new = torch.from_numpy(ids[:, position : position + count])
        with torch.no_grad():
            outputs.append(model(new, past_key_values=cache, use_cache=True).logits.float().numpy())
        position += count
    return outputs


def check_graph(references: list[np.ndarray], graph: Path, shape: ModelShape, ids) -> dict:
    """Compare logits step by step; return the record for the manifest or raise if out of bounds."""
    cases, largest, argmax_agree = {}, 0.0, True
    steps = _steps(graph, shape, ids[:, : sum(n for _, n in STEPS)])
    for (case, _, logits), reference in zip(steps, references, strict=True):
        cases[case] = float(np.abs(logits - reference).max())
        largest = max(largest, float(np.abs(reference).max()))
        argmax_agree &= bool((logits.argmax(-1) == reference.argmax(-1)).all())
    worst = max(cases.values())
    tolerance = RELATIVE_TOLERANCE * max(1.0, largest)
    record = {
        "cases": cases,
        "max_abs_logit_diff": worst,
        "max_abs_logit": largest,
        "tolerance": tolerance,
        "argmax_agree": argmax_agree,
    }
    if worst > tolerance:
        raise SpecrtError(
            f"{graph}: exported logits differ from PyTorch by {worst:.3g} "
            f"(tolerance {tolerance:.3g}; per step {cases}); the bundle was not written"
        )
    return record


def compare_converted(
    reference: Path, converted: Path, shape: ModelShape, ids: np.ndarray, positions: int
) -> dict:
    """How far a converted graph is from its float32 graph, on the same real-text steps: the
    largest logit difference, and the KL divergence and top-1 agreement of next-token choices."""
    diffs, parts = {}, []
    steps = converted_steps(positions)  # positions: what the graph's rotary tables cover
    ids = ids[:, : sum(n for _, n in steps)]
    pairs = zip(
        _steps(reference, shape, ids, steps), _steps(converted, shape, ids, steps), strict=True
    )
    position = 0
    for (case, new, want), (_, _, got) in pairs:
        if not np.isfinite(got).all():
            raise SpecrtError(
                f"{converted}: the converted graph produces non-finite logits ({case}); "
                "the bundle was not written"
            )
        diffs[case] = float(np.abs(got - want).max())
        position += new.shape[1]
        targets = ids[0, position - new.shape[1] + 1 : position + 1]  # the last predicts nothing
        parts.append(Comparison.of(got[0, : len(targets)], want[0, : len(targets)], targets))
    summary = Comparison.joined(parts).summary()
    return {
        "cases_vs_float32": diffs,
        "max_abs_logit_diff_vs_float32": max(diffs.values()),
        "kl_mean_vs_float32": summary.kl_mean,
        "top1_agreement_vs_float32": summary.top1_agreement,
        "sample_tokens": summary.tokens,
    }
