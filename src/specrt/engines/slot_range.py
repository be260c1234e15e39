"""A range of one engine's slots, as an engine of its own: several runtimes over one copy of the
weights, each with its own slots, costs and requests.

Why: runs compared side by side (a benchmark's target alone, fixed K and adaptive) must differ
only in what they decide. Each in a runtime of its own, they ran on their own copies of the
same weights, and where the operating system placed each copy moved a call's time by more than
the policies differ: on an AMX Xeon (480 MiB L3), the draft model's first step in a round took
51-88 ms in the runtime loaded first and 29-38 ms in the others, the same calls at the same
context, and adaptive ran 0.88-0.92x fixed K = 1 loaded before it and 1.08-1.09x loaded after
it. Over one engine's slots the three runs' calls took 29.8-30.2 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.engines.base import Engine, RowCall, check_slot


class SlotRange:
    """Slots first..first+slots-1 of `engine`, numbered from 0. Every call goes to the engine
    with its slots moved; the range shares the engine's weights and its cache buffers, and
    never touches a slot outside it."""

    def __init__(self, engine: Engine, first: int, slots: int):
        if first < 0 or slots < 1 or first + slots > engine.slots:
            raise ValueError(
                f"slots {first}..{first + slots - 1} are not all in an engine of {engine.slots}"
            )
        self.engine, self.first, self.slots = engine, first, slots
        self.vocab_size, self.capacity = engine.vocab_size, engine.capacity

    def _slot(self, slot: int) -> int:
        check_slot(self, slot)
        return self.first + slot

    @property
    def length(self) -> int:
        return self.lengths[0]

    @property
    def lengths(self) -> Sequence[int]:
        return self.engine.lengths[self.first : self.first + self.slots]

    def reset(self, slot: int = 0) -> None:
        self.engine.reset(self._slot(slot))

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        return self.forward_rows([(0, tokens)], last)[0]

    def forward_rows(self, rows: Sequence[RowCall], last: int | None = None) -> list[np.ndarray]:
        return self.engine.forward_rows([(self._slot(s), tokens) for s, tokens in rows], last)

    def rollback(self, length: int, slot: int = 0) -> None:
        self.engine.rollback(length, self._slot(slot))

    def release(self, slot: int, keep: int = 0) -> None:
        self.engine.release(self._slot(slot), keep)

    def held(self, slot: int = 0) -> Sequence[int]:
        return self.engine.held(self._slot(slot))

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        return self.engine.copy_prefix(self._slot(source), self._slot(slot), length)

    def read_positions(self, slot: int, start: int, end: int) -> np.ndarray | None:
        return self.engine.read_positions(self._slot(slot), start, end)

    def write_positions(self, slot: int, tokens: Sequence[int], data: np.ndarray) -> None:
        self.engine.write_positions(self._slot(slot), tokens, data)


def split_slots(engine: Engine, parts: int) -> list[SlotRange]:
    """The engine's slots in `parts` equal ranges, in order."""
    size, extra = divmod(engine.slots, parts)
    if extra or not size:
        raise ValueError(f"{engine.slots} slots do not split into {parts} equal ranges")
    return [SlotRange(engine, i * size, size) for i in range(parts)]
