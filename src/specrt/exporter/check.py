"""Check an exported graph against the PyTorch model it came from, before a bundle is written.

Greedy speculation promises the target's own tokens, so a graph that drifts from its source is
refused at build time rather than discovered in production. The check drives the graph exactly as
the runtime will: a prefill, then 1 token and then 5 tokens on top of the cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.graph import ModelShape

# Max |ORT logit - PyTorch logit| allowed, relative to the largest |logit| (float32 graphs).
# Measured: ~2e-6 relative on the tiny models; summation order alone stays far below this, while a
# wrong rotary, mask or cache position shows up as an error of order 1.
RELATIVE_TOLERANCE = 1e-3
STEPS = (("prefill", 12), ("decode", 1), ("verify", 5))


def check_graph(model, graph: Path, shape: ModelShape, *, seed: int = 0) -> dict:
    """Compare logits step by step; return the record for the manifest or raise if out of bounds."""
    import onnxruntime as ort
    import torch
    from transformers import DynamicCache

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    capacity = sum(n for _, n in STEPS)
    cache = {
        f"past_key_values.{i}.{kind}": np.zeros(
            (1, shape.num_kv_heads, capacity, shape.head_dim), np.float32
        )
        for i in range(shape.num_layers)
        for kind in ("key", "value")
    }
    ids = np.random.default_rng(seed).integers(0, shape.vocab_size, capacity)[None]
    reference_cache = DynamicCache(config=model.config)
    output_names = [o.name for o in session.get_outputs()]
    cases, largest, argmax_agree, position = {}, 0.0, True, 0
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
        with torch.no_grad():
            reference = (
                model(torch.from_numpy(new), past_key_values=reference_cache, use_cache=True)
                .logits.float()
                .numpy()
            )
        cases[f"{name}_{count}"] = float(np.abs(outputs[0] - reference).max())
        largest = max(largest, float(np.abs(reference).max()))
        argmax_agree &= bool((outputs[0].argmax(-1) == reference.argmax(-1)).all())
        position += count
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
