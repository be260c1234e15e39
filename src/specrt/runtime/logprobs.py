"""Log-probabilities of emitted tokens, from the target's own rows.

Every emitted token is the target's choice at its position (an accepted draft is scored by the
verify row at that position, the target's own token by the row after), so its log-probability
comes from that row: the same numbers the target alone gives, whatever drafted it. They are of
the distribution the request decodes from before temperature, top-k and top-p: the target's
logits after the request's constraints (grammar, logit_bias, penalties), as vLLM reports them
after its logits processors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there, best first
    text: str = ""  # the token's text, and the top tokens' (named by the generation)
    top_texts: tuple[str, ...] = ()


def check_top(top: int | None) -> int | None:
    if top is not None and not 0 <= top <= MAX_TOP:
        message = f"top_logprobs must be in [0, {MAX_TOP}], got {top}"
        raise SpecrtError(message, param="top_logprobs")
    return top


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i scores tokens[i]: its log-probability and the `top` best alternatives."""
    found = []
    for row, token in zip(rows, tokens, strict=True):
        scores = row.astype(np.float64)
        peak = scores.max()
        log_total = peak + np.log(np.exp(scores - peak).sum())
        best: tuple[tuple[int, float], ...] = ()
        if top:
            ids = np.argpartition(-scores, top - 1)[:top]
            ids = ids[np.argsort(-scores[ids], kind="stable")]
            best = tuple(
                (int(i), float(scores[i] - log_total)) for i in ids if np.isfinite(scores[i])
            )
        found.append(TokenLogprob(int(token), float(scores[token] - log_total), best))
    return found
