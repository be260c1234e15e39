"""When one request's output ends, and how much of its text may be shown yet.

A round emits a block of tokens at once, and EOS, a stop string or the token budget may land
anywhere inside it, so tokens are fed one at a time and the output is cut at that exact token
and character. A stream must never show part of a stop string, so text that could still grow
into one is held back until it either completes the stop (and is dropped) or cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from specrt.runtime.text import IncrementalDecoder, TextTokenizer


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopRules:
    """One request's text so far, how many tokens its output has, and why it finished (None
    while it runs). The tokens themselves stay on the `Sequence`: these rules see each once.

    finish is "eos", "stop" or "length"; the caller sets its own reasons (the context is full,
    a timeout, a cancellation) through `end`.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        stop: Sequence[str],
        eos: frozenset[int],
        max_new_tokens: int,
    ):
        self.stop, self.eos, self.max_new_tokens = [s for s in stop if s], eos, max_new_tokens
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.length = 0  # tokens of the output so far
        self.text = ""
        self.shown = 0
        self.finish: str | None = None

    def push(self, token: int) -> bool:
        """Take one token; True when it ends the output (it is kept: EOS is in the token ids,
        and the token that completes a stop string too, while its text is cut)."""
        self.length += 1
        if token in self.eos:
            return self.end("eos")
        self.decoder.push(token)
        hits = [i for i in (self.decoder.text.find(s) for s in self.stop) if i >= 0]
        self.text = self.decoder.text[: min(hits)] if hits else self.decoder.text
        if hits:
            return self.end("stop")
        if self.length >= self.max_new_tokens:
            return self.end("length")
        return False

    def end(self, reason: str) -> bool:
        if self.finish is None:
            self.finish = reason
        return True

    def release(self) -> str:
        """The text that may be shown now and was not yet: all of it once finished, else all
        but a tail that could still become a stop string."""
        safe = len(self.text)
        if self.finish is None:
            safe -= partial_stop(self.text, self.stop)
        delta = self.text[self.shown : safe] if safe > self.shown else ""
        self.shown = max(self.shown, safe)
        return delta
