"""Check an exported graph before a bundle is written: against PyTorch, and after a precision
conversion against the float32 graph it came from.

Greedy speculation promises the target's own tokens, so a float32 graph that drifts from its
source is refused at build time rather than discovered in production. A converted graph differs
on purpose; its difference is measured and recorded (what `inspect` shows), and only a broken one
(non-finite logits) is refused. Both checks drive the graph exactly as the runtime will: a
prefill, then 1 token and then 5 tokens on top of the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.graph import ModelShape

# Max |ORT logit - PyTorch logit| allowed, relative to the largest |logit| (float32 graphs).
# Measured: ~2e-6 relative on the tiny models; summation order alone stays far below this, while a
# wrong rotary, mask or cache position shows up as an error of order 1.
RELATIVE_TOLERANCE = 1e-3
STEPS = (("prefill", 12), ("decode", 1), ("verify", 5))
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _steps(
    graph: Path, shape: ModelShape, seed: int
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield (case name, new token ids, float32 logits) for each step, the cache carried over."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    capacity = sum(n for _, n in STEPS)
    cache = {
        i.name: np.zeros((1, shape.num_kv_heads, capacity, shape.head_dim), ORT_DTYPES[i.type])
        for i in session.get_inputs()
        if i.name.startswith("past_key_values.")
    }
    ids = np.random.default_rng(seed).integers(0, shape.vocab_size, capacity)[None]
    output_names = [o.name for o in session.get_outputs()]
    position = 0
    for name, count in STEPS:
        new = ids[:, position : position + count]
        outputs = session.run(
            None,
            {
                "input_ids": new,
                "attention_mask": np.ones((1, position + count), np.int64),
                "position_ids": np.arange(position, position + count)[None],
                "logits_to_keep": np.array([count]),
                **cache,
            },
        )
        for out_name, value in zip(output_names[1:], outputs[1:], strict=True):
            cache[out_name.replace("present", "past_key_values")] = value
        yield f"{name}_{count}", new, outputs[0].astype(np.float32)
        position += count


def check_graph(model, graph: Path, shape: ModelShape, *, seed: int = 0) -> dict:
    """Compare logits step by step; return the record for the manifest or raise if out of bounds."""
    import torch
    from transformers import DynamicCache

    reference_cache = DynamicCache(config=model.config)
    cases, largest, argmax_agree = {}, 0.0, True
    for case, new, logits in _steps(graph, shape, seed):
        with torch.no_grad():
            reference = (
                model(torch.from_numpy(new), past_key_values=reference_cache, use_cache=True)
                .logits.float()
                .numpy()
            )
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
    reference: Path, converted: Path, shape: ModelShape, *, seed: int = 0
) -> dict:
    """How far a converted graph's logits are from its float32 graph's, on the same steps."""
    diffs, agree, positions = {}, 0, 0
    pairs = zip(_steps(reference, shape, seed), _steps(converted, shape, seed), strict=True)
    for (case, _, want), (_, _, got) in pairs:
        if not np.isfinite(got).all():
            raise SpecrtError(
                f"{converted}: the converted graph produces non-finite logits ({case}); "
                "the bundle was not written"
            )
        diffs[case] = float(np.abs(got - want).max())
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        positions += want.shape[1]
    return {
        "cases_vs_float32": diffs,
        "max_abs_logit_diff_vs_float32": max(diffs.values()),
        "argmax_agreement_vs_float32": agree / positions,
    }
