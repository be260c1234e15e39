"""How a model's next-token distributions compare with a reference's on the same tokens:
negative log-likelihoods, KL divergence and top-1 agreement per position.

The build's check (check.py) holds a graph to these against its float32 reference, and
`specrt eval` (tools/quality.py) reports them on real text. Pure numpy: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

PROSE = Path(__file__).parents[1] / "data" / "prose.txt"  # an English sample shipped with specrt


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class Comparison:
    """Per-position figures of a model and its reference on the same tokens."""

    nll: np.ndarray  # the model's negative log-likelihood of each next token
    reference_nll: np.ndarray
    kl: np.ndarray  # KL(reference || model) of each next-token distribution
    agree: np.ndarray  # both argmaxes equal

    @classmethod
    def of(cls, logits: np.ndarray, reference: np.ndarray, targets: np.ndarray) -> Comparison:
        """logits, reference: [n, vocab] predicting targets [n]."""
        got, want = log_softmax(logits), log_softmax(reference)
        rows = np.arange(len(targets))
        return cls(
            nll=-got[rows, targets],
            reference_nll=-want[rows, targets],
            kl=(np.exp(want) * (want - got)).sum(axis=-1),
            agree=logits.argmax(-1) == reference.argmax(-1),
        )

    @classmethod
    def joined(cls, parts: Sequence[Comparison]) -> Comparison:
        return cls(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__)
        )

    def summary(self) -> Summary:
        return Summary(
            tokens=int(self.nll.size),
            perplexity=float(np.exp(self.nll.mean())),
            reference_perplexity=float(np.exp(self.reference_nll.mean())),
            kl_mean=float(self.kl.mean()),
            kl_p99=float(np.percentile(self.kl, 99)),
            top1_agreement=float(self.agree.mean()),
        )


@dataclass(frozen=True)
class Summary:
    tokens: int
    perplexity: float
    reference_perplexity: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float

    @property
    def perplexity_change(self) -> float:
        return self.perplexity / self.reference_perplexity - 1

    def as_dict(self) -> dict:
        return {**asdict(self), "perplexity_change": self.perplexity_change}
