"""Sampling parameters and the one function that turns logits into the distribution sampled from.

Speculative sampling is lossless only if the draft's q and the target's p go through exactly the
same temperature / top-k / min-p / top-p processing, so both call `probabilities` and nothing
else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError

# Top-p first looks among this many best tokens; it sorts the whole vocabulary only when they
# do not reach top_p. A full sort of a 152k vocabulary costs milliseconds per position.
TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SpecrtError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}",
                param="temperature",
            )
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise SpecrtError(
                f"top_k must be a whole number >= 0 (0 = off), got {self.top_k}", param="top_k"
            )
        if not 0 < self.top_p <= 1:
            raise SpecrtError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}", param="top_p")
        if not 0 <= self.min_p <= 1:
            raise SpecrtError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}", param="min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from (float64, sums to 1), after all processing:
    temperature, top-k, min-p (a token stays if its probability is at least min_p times the
    most likely one's, as vLLM and transformers define it), then top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return _nucleus(probs, params.top_p) if params.top_p < 1 else probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    count = min(TOP_P_CANDIDATES, probs.size)
    order = np.argpartition(-probs, count - 1)[:count]
    order = order[np.argsort(-probs[order], kind="stable")]
    mass = np.cumsum(probs[order])
    if mass[-1] < top_p and count < probs.size:
        order = np.argsort(-probs, kind="stable")
        mass = np.cumsum(probs[order])
    kept = order[: int(np.searchsorted(mass, top_p)) + 1]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw by inverse CDF (faster than rng.choice for large vocabularies)."""
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(index, probs.size - 1)


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, threshold: float):
    """A model's token, the distribution it was drawn from (None when greedy: a point mass),
    and its confidence: the top probability (1.0 when greedy and not asked for)."""
    if params.greedy:
        confidence = 1.0
        if threshold > 0:
            shifted = np.exp(logits - logits.max())
            confidence = float(1.0 / shifted.sum())
        return int(logits.argmax()), None, confidence
    probs = probabilities(logits, params)
    return sample(probs, rng), probs, float(probs.max())
