"""One request's rules on its next token, applied alike to the draft's rows and the target's.

A grammar's mask, OpenAI's logit_bias and its presence and frequency penalties all change the
logits a token is drawn from, and each depends on what came before: the grammar on every token
so far, the penalties on how often each output token occurred. Speculation scores positions
the output has not reached: draft step j comes after j drafted tokens, and verify row i after
the first i drafts. So `Constraints` is the request's one cursor over its output (the grammar
keeps no position of its own): it stands after the emitted tokens, walks over drafts
(`advance`), processes the logits of the position it stands at (`apply`), and steps back to
where the round's accepted tokens end (`close_round`). The output itself lives on the
`Sequence`; the cursor keeps only counts and the drafts of the round in flight. Every row,
draft or target, is processed at its own position, so the target's distribution at each
position is exactly its constrained distribution alone, and rejection sampling over processed
rows keeps it.

Penalties count output tokens only (not the prompt), as OpenAI and vLLM do: a token's logit is
lowered by frequency_penalty times its count so far, and by presence_penalty once it occurred.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.grammar import Grammar

PENALTY_RANGE = 2.0  # OpenAI's bounds on presence_penalty and frequency_penalty
BIAS_RANGE = 100.0  # ... and on each logit_bias value


class Constraints:
    def __init__(
        self,
        grammar: Grammar | None = None,
        *,
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        eos: frozenset[int] = frozenset(),
        vocab: int | None = None,
        jump_forward: bool = True,
    ):
        """jump_forward: offer the grammar's forced tokens as drafts (`forced`); off, drafts
        come from the drafter alone (what a comparison without them needs)."""
        for name, value in (
            ("presence_penalty", presence_penalty),
            ("frequency_penalty", frequency_penalty),
        ):
            if not np.isfinite(value) or abs(value) > PENALTY_RANGE:
                raise SpecrtError(f"{name} must be in [-2, 2], got {value}", param=name)
        self.grammar = grammar
        self.bias = _bias(logit_bias or {}, vocab)
        self.presence, self.frequency = presence_penalty, frequency_penalty
        self.eos, self.jump_forward = eos, jump_forward
        self.position = 0  # the cursor: output tokens walked (the grammar stands here too)
        self.base = 0  # where the last round ended: the output walked for good
        # Tokens walked past base this round (drafts), kept past a rollback while they may be
        # walked again: the grammar's masks along them serve the verify rows.
        self.path: list[int] = []
        self.counts: Counter[int] = Counter()

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits of the position the cursor stands at, processed (a new array). A draft's
        logits may be narrower than the target's (padded vocabularies): ids past them are
        left out."""
        out = logits.astype(np.float32, copy=True)
        width = out.shape[-1]
        if self.bias is not None:
            ids, values = self.bias
            keep = ids < width
            out[ids[keep]] += values[keep]
        if self.counts and (self.presence or self.frequency):
            ids = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            counts = np.fromiter(self.counts.values(), dtype=np.float32, count=len(ids))
            keep = ids < width
            out[ids[keep]] -= self.frequency * counts[keep] + self.presence
        if self.grammar is not None:
            out[~self.grammar.allowed(self.position)[:width]] = -np.inf
        return out

    def apply_rows(self, rows: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """A verify call's rows (row i after the first i drafts), each processed at its own
        position; the cursor ends after the drafts."""
        out = np.empty(rows.shape, dtype=np.float32)
        for i, row in enumerate(rows):
            out[i] = self.apply(row)
            if i < len(drafts):
                self.advance(drafts[i : i + 1])
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """Move the cursor over tokens (an EOS ends the output: nothing walks past it)."""
        for token in tokens:
            if token in self.eos:
                return
            i = self.position - self.base
            if i >= len(self.path) or self.path[i] != token:
                del self.path[i:]  # a new path: what was walked past here is not its
                self.path.append(token)
                if self.grammar is not None:
                    self.grammar.forget_after(self.position)
            if self.grammar is not None:
                self.grammar.consume(token)
            self.position += 1
            self.counts[token] += 1

    def rollback_to(self, position: int) -> None:
        """Step back to position (the output's length there; not before this round's start).
        The path walked past it is remembered."""
        for token in self.path[position - self.base : self.position - self.base]:
            self.counts[token] -= 1
            if not self.counts[token]:
                del self.counts[token]
        if self.grammar is not None and position < self.position:
            self.grammar.rollback(self.position - position)
        self.position = min(self.position, position)

    def close_round(self, kept: Sequence[int]) -> None:
        """A round ends with `kept` emitted after the last: the cursor stands after them, and
        the grammar forgets what lies behind."""
        self.rollback_to(self.base)
        self.advance(kept)
        del self.path[: self.position - self.base]
        self.base = self.position
        if self.grammar is not None:
            self.grammar.settle(self.position)

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, may follow the cursor."""
        if self.grammar is None:
            return len(tokens)
        return self.grammar.accepts(tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next ([] without one, where it may end, or with
        jump_forward off)."""
        if self.grammar is None or self.grammar.finished or not self.jump_forward:
            return []
        return self.grammar.forced()


def _bias(bias: Mapping[int, float], vocab: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """logit_bias as (ids, values), each checked: ids within the vocabulary, values in ±100."""
    if not bias:
        return None
    ids, values = [], []
    for token, value in bias.items():
        token = int(token)
        if token < 0 or (vocab is not None and token >= vocab):
            raise SpecrtError(
                f"logit_bias names token {token}, outside the vocabulary (0..{vocab})",
                param="logit_bias",
            )
        if not np.isfinite(value) or abs(value) > BIAS_RANGE:
            raise SpecrtError(
                f"logit_bias values must be in [-100, 100], got {value} for token {token}",
                param="logit_bias",
            )
        ids.append(token)
        values.append(value)
    return np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32)
