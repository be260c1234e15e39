"""The engine protocol: what the runtime may ask of any backend, and nothing more.

An engine owns one model and its KV cache for a single sequence (batch size 1). The runtime feeds
new tokens, reads their logits, and rolls the cache back to the emitted prefix after a rejection;
it never learns which backend it drives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from specrt.errors import SpecrtError


@runtime_checkable
class Engine(Protocol):
    vocab_size: int
    capacity: int  # the most positions the cache holds (the bundle's max context)

    @property
    def length(self) -> int:
        """Positions currently in the cache."""

    def reset(self) -> None:
        """Forget the sequence: the next forward starts at position 0."""

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        """Append tokens to the cache; return float32 logits [n, vocab] for the last n of them.

        n defaults to all of them (verify); a prefill asks for last=1.
        """

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions; must cost O(1)."""


def check_room(engine: Engine, count: int, last: int | None) -> int:
    """Validate a forward call's sizes before any backend work; return how many logits to keep."""
    if count < 1:
        raise ValueError("forward needs at least one token")
    if engine.length + count > engine.capacity:
        raise SpecrtError(
            f"context full: {engine.length} cached + {count} new tokens exceed the bundle's "
            f"max context of {engine.capacity}"
        )
    keep = count if last is None else last
    if not 1 <= keep <= count:
        raise ValueError(f"last must be in 1..{count}, got {last}")
    return keep


def check_rollback(engine: Engine, length: int) -> None:
    if not 0 <= length <= engine.length:
        raise ValueError(f"cannot roll back to {length}: the cache holds {engine.length}")


class BufferCache:
    """Position bookkeeping for engines whose cache is a buffer preallocated at max context:
    the graph writes at the current length, so a rollback only moves the length (O(1))."""

    _length = 0

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def rollback(self, length: int) -> None:
        check_rollback(self, length)
        self._length = length
