"""How close a quantized model is to its reference, on real text.

The numbers llama.cpp users already compare with `llama-perplexity --kl-divergence`: the model's
perplexity on a text, and against a reference scoring the same tokens, the KL divergence of the
next-token distributions (mean and 99th percentile) and how often both pick the same top token.
Random tokens say little about either (every model is lost on them), so the texts are real: a
file of Python's own standard library and an English prose sample shipped with the package.

Pure numpy over engines' logits: it runs on any backend and never imports torch itself.
"""

from __future__ import annotations

import json.decoder
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.exporter.agreement import PROSE, Comparison
from specrt.runtime.text import TextTokenizer

DEFAULT_TEXTS = (Path(json.decoder.__file__), PROSE)  # code and prose
DEFAULT_TOKENS = 512
CHUNK = 32  # tokens per call: well inside every engine's verify window


def compare(engine: Engine, reference: Engine, tokens: Sequence[int]) -> Comparison:
    """Score tokens with both engines from an empty cache, CHUNK tokens per call."""
    if len(tokens) < 2:
        raise SpecrtError(f"comparing needs at least two tokens of text, got {len(tokens)}")
    for e in (engine, reference):
        e.reset()
    parts = []
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = list(tokens[start : start + CHUNK])
        targets = np.asarray(tokens[start + 1 : start + 1 + len(chunk)])
        got, want = engine.forward(chunk), reference.forward(chunk)
        n = len(targets)  # the text's last token predicts nothing
        parts.append(Comparison.of(got[:n], want[:n], targets))
    return Comparison.joined(parts)


def text_tokens(path: Path, encode, count: int = DEFAULT_TOKENS) -> list[int]:
    """The first count tokens of a text file (all of it when shorter)."""
    return list(encode(path.read_text(encoding="utf-8")))[:count]


def text_labels(texts: Sequence[Path]) -> list[str]:
    """What each text is reported as: its file name, or the path as given where two texts
    share a name (`a/notes.txt` and `b/notes.txt` would otherwise be one entry)."""
    names = [text.name for text in texts]
    return [text.name if names.count(text.name) == 1 else str(text) for text in texts]


def evaluate(
    bundle: Bundle,
    reference: Bundle | None = None,
    texts: Sequence[Path] = DEFAULT_TEXTS,
    *,
    tokens: int = DEFAULT_TOKENS,
    threads: int | None = None,
) -> dict[str, dict[str, dict]]:
    """{role: {text label: summary}} for every role of bundle, against the same role of
    reference, or by default the role's own source run by PyTorch in float32 (the model a
    float32 build would run; it needs the export extra)."""
    from specrt.engines.onnxruntime import OrtEngine

    results: dict[str, dict[str, dict]] = {}
    encode = TextTokenizer.from_bundle(bundle).encode
    samples = {
        label: text_tokens(text, encode, tokens)
        for label, text in zip(text_labels(texts), texts, strict=True)
    }
    for role in bundle.roles:
        engine = OrtEngine.from_bundle(bundle, role, threads=threads)
        if reference is not None:
            if role not in reference.roles:
                raise SpecrtError(f"the reference bundle {reference.path} has no {role}")
            baseline = OrtEngine.from_bundle(reference, role, threads=threads)
        else:
            baseline = _float32_source(bundle, role, threads)
        results[role] = {
            name: compare(engine, baseline, ids).summary().as_dict()
            for name, ids in samples.items()
        }
    return results


def _float32_source(bundle: Bundle, role: str, threads: int | None) -> Engine:
    try:
        from specrt.engines.torch import TorchEngine
    except ImportError as err:
        raise SpecrtError(
            "the default reference runs the source model in PyTorch: install the export extra "
            "(pip install 'specrt[export]'), or pass --reference with a float32 bundle"
        ) from err
    return TorchEngine.from_bundle(bundle, role, threads=threads)


def quality_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    """A table: one line per role and text."""
    lines = [
        f"{'role':8} {'text':16} {'tokens':>6} {'ppl':>8} {'ref ppl':>8} {'Δppl':>7} "
        f"{'KL mean':>9} {'KL p99':>8} {'top-1':>7}"
    ]
    for role, texts in results.items():
        for name, s in texts.items():
            lines.append(
                f"{role:8} {name:16} {s['tokens']:>6} {s['perplexity']:>8.3f} "
                f"{s['reference_perplexity']:>8.3f} {s['perplexity_change']:>+7.1%} "
                f"{s['kl_mean']:>9.4f} {s['kl_p99']:>8.3f} {s['top1_agreement']:>7.1%}"
            )
    return lines


RECORDED = ("kl_mean_vs_float32", "top1_agreement_vs_float32", "sample_tokens")


def recorded_quality(bundle: Bundle) -> dict[str, dict]:
    """Each role's precision and how far it is from float32, as its build measured it on the
    prose sample (`specrt eval` measures more text; this costs nothing at bench time)."""
    found = {}
    for name in bundle.roles:
        role = bundle.role(name)
        check = role.info["export_check"]
        found[name] = {"precision": role.precision, **{k: check[k] for k in RECORDED if k in check}}
    return found
