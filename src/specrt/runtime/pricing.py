"""What a round of a batch is expected to earn and cost: the arithmetic the adaptive policy
(controller.py) maximises, and the replay and ceiling tools price with.

With per-token acceptance α, a request drafting K tokens emits E = (1 - α^(K+1)) / (1 - α)
tokens a round, times its shape at K where the order of its judged guesses gives one
(runs.py: a guess after a kept one is kept more often); a round costs the draft steps of the
rows that draft (their catch-ups included) plus one verify call as wide as the batch times its
widest K + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.runtime.costs import StepCosts

ROUND_LAG = 2  # tokens a round leaves the draft model to read: a steady cost, not a catch-up


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits with k drafts at per-token acceptance alpha (the bonus included)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def price_round(
    ks, alphas, sources, lags, others, costs: StepCosts, shapes=None
) -> tuple[float, float, float]:
    """Expected tokens per second of a round where the joint requests draft ks, and the
    seconds of its draft steps (their catch-ups included: a request that drafted at K = 0 for
    a while must first feed the draft model what it missed, and in a busy batch every other
    request waits for it) and of its verify call. lags: (lag, remaining tokens) per request;
    shapes: per request, a factor per K on its expected tokens, or None (1 at every K)."""
    drafting = [
        (k, alpha, lag)
        for k, alpha, s, lag in zip(ks, alphas, sources, lags, strict=True)
        if s == "model" and k
    ]
    k_draft = max((k for k, _, _ in drafting), default=0)
    first = first_step_rows([(k, alpha) for k, alpha, _ in drafting])
    draft = costs.draft_cost("model", k_draft, len(drafting), first)
    draft += sum(
        _catch_up_share(costs, k, alpha, *lag) for k, alpha, lag in drafting if lag[0] > ROUND_LAG
    )
    verify = costs.verify_cost(verify_rows(ks, others), len(ks) + len(others))
    shapes = shapes or [None] * len(ks)
    tokens = len(others) + sum(
        expected_tokens(alpha, k) * (shape[k] if shape else 1.0)
        for alpha, k, shape in zip(alphas, ks, shapes, strict=True)
    )
    return tokens / (draft + verify), draft, verify


def verify_rows(ks: Sequence[int], others: Sequence[int]) -> int:
    """Rows of a round's verify call: every request padded to the widest K + 1, the batch's
    other requests (`others`, their K) included."""
    return (len(ks) + len(others)) * (max([*ks, *others]) + 1)


def first_step_rows(drafting: Sequence[tuple[int, float]]) -> float:
    """Expected rows of a round's first draft step, for requests drafting (K, alpha) each, in
    steady state. The draft model never reads its own last proposal, so after a round that kept
    all K drafts a request feeds it two tokens (that draft and the target's), else one; the
    batched step is padded to its widest request. Priced as one token a request, the draft of
    4 requests at K = 1 cost 1.7x its estimate (measured: 44 ms a round where the curve said
    26 ms), and the policy drafted at 4 clients where the target alone was faster."""
    if not drafting:
        return 0.0
    none_kept_all = float(np.prod([1 - alpha**k for k, alpha in drafting]))
    return len(drafting) * (2 - none_kept_all)


def _catch_up_share(costs: StepCosts, k: int, alpha: float, lag: int, remaining: int) -> float:
    """A catch-up is paid once and serves every later round of the request, so its price is
    spread over the rounds the request's remaining tokens take at this K: early in a long
    answer it is cheap, near the end it is not. A fixed spread (4 rounds) priced a long
    idle stretch so dear that a busy batch never drafted again (measured at 8 clients: K = 0
    throughout, where K = 2 gave 1.13x the target alone)."""
    return costs.catch_up_cost(lag) / max(1.0, remaining / expected_tokens(alpha, k))
