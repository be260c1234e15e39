"""Decide how many drafted tokens survive, and which token the target adds after them.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023: accept draft token x with probability
min(1, p(x) / q(x)); at the first rejection draw from normalize(max(0, p - q)); when every draft
survives draw a bonus token from the target's next distribution. The emitted tokens are then
distributed exactly as if the target had sampled them alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.runtime.sampling import SamplingParams, probabilities, sample


def verify_greedy(drafts: Sequence[int], target_logits: np.ndarray) -> tuple[int, int]:
    """Accept while each draft equals the target's argmax; return (accepted, next token)."""
    choices = target_logits.argmax(axis=-1)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return accepted, int(choices[accepted])


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalize(max(0, p - q)): what the target still owes after the draft's proposal."""
    left = np.maximum(p - q, 0.0)
    total = left.sum()
    return left / total if total > 0 else p


def _same_ids(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A draft and a target whose logits are padded differently past the tokenizer's ids: both
    distributions over the union of ids, each zero where its model has no logit. Rejection
    sampling over that union is exact as ever: an id the target lacks has p = 0, so a draft of
    it is always rejected."""
    size = max(len(p), len(q))
    return np.pad(p, (0, size - len(p))), np.pad(q, (0, size - len(q)))


def verify_sampled(
    drafts: Sequence[int],
    draft_probs: Sequence[np.ndarray | None],
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Rejection-sample the drafts against the target; return (accepted, next token).

    draft_probs[i] must be the very distribution drafts[i] was drawn from; None is a point mass
    on drafts[i] (a lookup, or any deterministic proposal): accepted with probability p(x), and
    on rejection the next token comes from p without x, renormalised.
    """
    for i, token in enumerate(drafts):
        p = probabilities(target_logits[i], params)
        q = draft_probs[i]
        if q is None:
            q = np.zeros_like(p)
            q[token] = 1.0
        elif len(q) != len(p):
            p, q = _same_ids(p, q)
        if rng.random() * q[token] < p[token]:  # u < p/q without dividing by q
            continue
        return i, sample(residual(p, q), rng)
    return len(drafts), sample(probabilities(target_logits[len(drafts)], params), rng)
