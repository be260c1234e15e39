"""The client's guess of the output (OpenAI's Predicted Outputs) as a free, lossless draft.

A prediction is text the client expects back mostly unchanged: a file with one function edited,
a document with two facts updated. While the output follows it, the prediction's next tokens are
the draft. Where the output leaves it (the edit), the drafter looks for the output's last few
tokens in the prediction and goes on from there, nearest after where it was first (edits keep
the order of the text), else the last match before. Where the prediction has nothing, a lookup
in the context (the n-gram drafter's: the prompt usually quotes the text being edited, and the
output repeats itself) proposes for free, and only where that finds nothing either does the
request's own drafter (the draft model) propose. Its offer then says how much of the prediction
lies ahead, so that the controller weighs a draft model's catch-up against the few rounds it
will draft before the output is back on the prediction, not against the whole budget.

Matching is on text, not tokens: the prediction tokenized alone may split differently from the
same text inside the output (`(x` against `(`, `x`). So the drafter keeps the prediction as text
with the character each of its tokens ends at; a match that ends on one of those boundaries
moves the cursor there, and one that ends inside a token tokenizes the rest of the text again
from that character. Every draft is verified like any other, so the output stays the target's,
whatever the prediction: the draft is a point mass, which rejection sampling handles exactly.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace

from specrt.runtime.drafters import Drafter, NgramDrafter, Offer, Proposal
from specrt.runtime.prompt_cache import PromptCache
from specrt.runtime.text import TextTokenizer

ANCHOR_TOKENS = 8  # the longest tail of the output sought in the prediction...
MIN_ANCHOR_TOKENS = 2  # ...and the shortest
MIN_ANCHOR_CHARS = 3  # a tail shorter than this (a space, a newline) matches almost anywhere


class PredictionDrafter:
    """Drafts from a prediction's text; `fallback` (the request's drafter, or None for no draft)
    proposes where the output matches nothing in it."""

    name = "prediction"

    def __init__(self, text: str, tokenizer: TextTokenizer, fallback: Drafter | None):
        self.text, self.tokenizer, self.fallback = text, tokenizer, fallback
        self.model = fallback.model if fallback is not None else None
        self.lookup = NgramDrafter()
        self._output = 0  # where the output begins in the sequence
        self._base = 0  # the character of the text its tokens below start at
        self._tokens: list[int] = []
        self._ends: list[int] = []  # the character each token ends at, from _base
        self._cursor = 0  # the next token of the prediction the output would continue with
        self._synced = 0  # the length of the sequence the cursor stands after
        self._proposing: Drafter | None = None  # who proposes this round (None: the prediction)
        self._tokenize_from(0)
        self.length = len(self._tokens)  # the prediction's tokens, tokenized alone

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        if self.fallback is not None:
            self.fallback.start(prompt, slot, cache)
        self.lookup.start(prompt, slot, cache)
        self._output = self._synced = len(prompt)
        self._stand_at(0)

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        self._proposing = None
        if self._follow(seq) or self._resync(seq):
            available = min(len(self._tokens) - self._cursor, limit)
            if available > 0:
                return Offer("prediction", available)
        self._proposing = self.lookup
        offer = self.lookup.offer(seq, limit)
        if not offer.available and self.fallback is not None:
            self._proposing = self.fallback
            offer = self.fallback.offer(seq, limit)
        return replace(offer, free_ahead=len(self._tokens) - self._cursor)

    def propose(self, seq, k, params, rng, threshold) -> Proposal:
        if self._proposing is not None:
            return self._proposing.propose(seq, k, params, rng, threshold)
        tokens = self._tokens[self._cursor : self._cursor + k]
        return Proposal(tokens, [None] * len(tokens))

    def rollback(self, length: int) -> None:
        if self.fallback is not None:
            self.fallback.rollback(length)

    def _follow(self, seq: Sequence[int]) -> bool:
        """Move the cursor over new output tokens that continue the prediction; True when every
        one did (the output still follows it)."""
        tokens, end = self._tokens, len(self._tokens)
        while self._synced < len(seq) and self._cursor < end:
            if seq[self._synced] != tokens[self._cursor]:
                return False
            self._synced += 1
            self._cursor += 1
        return self._synced == len(seq)

    def _resync(self, seq: Sequence[int]) -> bool:
        """Stand after the output's last few tokens where their text occurs in the prediction."""
        output = seq[self._output :]
        here = self._base + (self._ends[self._cursor - 1] if self._cursor else 0)
        for n in range(min(ANCHOR_TOKENS, len(output)), MIN_ANCHOR_TOKENS - 1, -1):
            anchor = self.tokenizer.decode(output[-n:]).strip("\ufffd")  # cut characters
            if len(anchor) < MIN_ANCHOR_CHARS:
                continue
            found = self.text.find(anchor, max(0, here - len(anchor)))
            if found < 0:
                found = self.text.rfind(anchor)
            if found >= 0:
                self._stand_at(found + len(anchor))
                self._synced = len(seq)
                return True
        return False

    def _stand_at(self, char: int) -> None:
        """Put the cursor at a character of the text: at a token boundary, or by tokenizing the
        rest of the text again from there."""
        offset = char - self._base
        index = bisect_right(self._ends, offset)  # the tokens ending there or before
        if offset == 0 or (offset > 0 and index and self._ends[index - 1] == offset):
            self._cursor = index
        else:
            self._tokenize_from(char)

    def _tokenize_from(self, char: int) -> None:
        self._base, self._cursor = char, 0
        self._tokens, self._ends = self.tokenizer.encode_spans(self.text[char:])
