"""The engine protocol: what the runtime may ask of any backend, and nothing more.

An engine owns one model and a KV cache of `slots` sequences side by side (the rows of a batched
call). The runtime feeds each row's new tokens, reads their logits, and rolls a row's cache back
to its emitted prefix after a rejection; it never learns which backend it drives. An engine
also knows which tokens each slot holds, so a new sequence can start from what a slot already
computed of its prompt (runtime/prompt_cache.py). Engines that
hold one sequence (the PyTorch reference, TensorRT today) have one slot, and a batched call of
that one row is their plain forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from specrt.errors import SpecrtError

RowCall = tuple[int, Sequence[int]]  # (slot, new tokens) in a batched call


@runtime_checkable
class Engine(Protocol):
    vocab_size: int
    capacity: int  # the most positions a slot holds (the bundle's max context)
    slots: int  # sequences the cache holds side by side

    @property
    def length(self) -> int:
        """Positions currently in slot 0's cache."""

    @property
    def lengths(self) -> Sequence[int]:
        """Positions currently in each slot's cache."""

    def reset(self, slot: int = 0) -> None:
        """Forget a slot's sequence: its next forward starts at position 0."""

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        """Append tokens to slot 0; return float32 logits [n, vocab] for the last n of them.

        n defaults to all of them (verify); a prefill asks for last=1.
        """

    def forward_rows(self, rows: Sequence[RowCall], last: int | None = None) -> list[np.ndarray]:
        """One call for several slots, each with its own new tokens; per row, the logits of its
        last `last` tokens (all of them by default), as `forward` gives for one."""

    def rollback(self, length: int, slot: int = 0) -> None:
        """Keep only the first `length` positions of a slot; must cost O(1)."""

    def release(self, slot: int, keep: int = 0) -> None:
        """Keep at most a slot's first `keep` positions and give the memory of the rest back
        where the backend can (the CPU engine's pages); a rollback where it cannot."""

    def held(self, slot: int = 0) -> Sequence[int]:
        """The tokens whose keys and values a slot holds, in order (its first lengths[slot])."""

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """Make `slot` hold the first `length` positions of `source`, copied; False where the
        backend cannot copy between slots (the caller then feeds the tokens)."""

    def read_positions(self, slot: int, start: int, end: int) -> np.ndarray | None:
        """A host copy of the keys and values a slot holds at positions start..end, in a form
        only `write_positions` reads; None where the backend keeps no host cache."""

    def write_positions(self, slot: int, tokens: Sequence[int], data: np.ndarray) -> None:
        """Append to a slot, at its length, the positions of these tokens as `read_positions`
        gave them (from any slot), as if they had been fed."""


def check_room(engine: Engine, count: int, last: int | None, slot: int = 0) -> int:
    """Validate a forward call's sizes before any backend work; return how many logits to keep."""
    if count < 1:
        raise ValueError("forward needs at least one token")
    if engine.lengths[slot] + count > engine.capacity:
        raise SpecrtError(
            f"context full: {engine.lengths[slot]} cached + {count} new tokens exceed the "
            f"bundle's max context of {engine.capacity}"
        )
    keep = count if last is None else last
    if not 1 <= keep <= count:
        raise ValueError(f"last must be in 1..{count}, got {last}")
    return keep


def check_rollback(engine: Engine, length: int, slot: int = 0) -> None:
    if not 0 <= length <= engine.lengths[slot]:
        raise ValueError(
            f"cannot roll back slot {slot} to {length}: its cache holds {engine.lengths[slot]}"
        )


def check_slot(engine: Engine, slot: int) -> None:
    if not 0 <= slot < engine.slots:
        raise ValueError(f"slot {slot} does not exist: this engine holds {engine.slots}")


class BufferCache:
    """Position bookkeeping for engines whose cache is a buffer preallocated at max context:
    the graph writes at each slot's current length, so a rollback only moves a length (O(1))."""

    slots = 1
    _lengths: list[int]
    _tokens: list[list[int]]  # per slot, what it was fed; valid up to its length

    def _start_cache(self, slots: int) -> None:
        self._lengths = [0] * slots
        self._tokens = [[] for _ in range(slots)]

    def _wrote(self, slot: int, tokens: Sequence[int]) -> None:
        """A call appended these tokens to the slot."""
        kept = self._tokens[slot]
        del kept[self._lengths[slot] :]
        kept.extend(tokens)
        self._lengths[slot] += len(tokens)

    def held(self, slot: int = 0) -> Sequence[int]:
        check_slot(self, slot)
        return self._tokens[slot][: self._lengths[slot]]

    @property
    def length(self) -> int:
        return self._lengths[0]

    @property
    def lengths(self) -> Sequence[int]:
        return self._lengths

    def reset(self, slot: int = 0) -> None:
        check_slot(self, slot)
        self._lengths[slot] = 0

    def rollback(self, length: int, slot: int = 0) -> None:
        check_slot(self, slot)
        check_rollback(self, length, slot)
        self._lengths[slot] = length

    def release(self, slot: int, keep: int = 0) -> None:
        """A rollback to at most `keep`: a preallocated buffer has no memory to give back."""
        check_slot(self, slot)
        self._lengths[slot] = min(self._lengths[slot], keep)


class OneSlot:
    """For engines that hold one sequence: a batched call can only be that one row."""

    slots = 1

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        return False  # one slot: nothing to copy from

    def read_positions(self, slot: int, start: int, end: int) -> np.ndarray | None:
        return None  # the backend's own cache: no host copy to keep

    def release(self, slot: int, keep: int = 0) -> None:
        """A rollback to at most `keep`: the memory stays the backend's."""
        self.rollback(min(keep, self.length), slot)

    def forward_rows(self, rows: Sequence[RowCall], last: int | None = None) -> list[np.ndarray]:
        if len(rows) != 1 or rows[0][0] != 0:
            raise SpecrtError(
                f"{type(self).__name__} holds one sequence; batched calls need the ONNX "
                "Runtime engine"
            )
        return [self.forward(rows[0][1], last)]
