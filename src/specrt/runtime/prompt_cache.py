"""Prompt reuse: a new sequence starts from what a slot's cache already holds of its prompt.

A chat's next turn resends the whole conversation, n choices send one prompt n times, and a
service's requests share its system prompt; on a CPU a prompt costs as much time as a few
dozen output tokens per hundred. So before a prefill the longest prefix of the prompt that any
slot holds is kept: in place where it is the request's own slot (a rollback), copied where it
is another's, and only the rest is fed. Which free slot a request takes decides what survives
for later requests: its own conversation's slot where one is free, else the one released
longest ago (`choose_slot`), as llama-server picks its slots by similarity and then age.
With a prefix store (`--prefix-cache`), what a slot held is not lost when it is overwritten:
it is kept in host memory, and a prompt restores it from there where that holds more of it
than any slot (prefix_store.py).

This changes no output. Reused keys and values were computed by other calls (a prefill cut
elsewhere, a verify round beside other rows), and the engines already guarantee that a
position's numbers depend on neither how calls are cut nor their neighbours: that is what lets
a verify call reproduce one-token decoding (see docs/batching.md, "Batch invariance").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specrt.engines.base import Engine
from specrt.runtime.prefix_store import Block, PrefixStore


def shared_length(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens the two have in common."""
    n = min(len(held), len(tokens))
    for i in range(n):
        if held[i] != tokens[i]:
            return i
    return n


class PromptCache:
    """Where a new sequence's prompt may start from: what the engine's slots hold, and the
    prefixes kept beyond them in host memory where there is a store (prefix_store.py)."""

    def __init__(self, store: PrefixStore | None = None):
        self.store = store

    @property
    def store_bytes(self) -> int:
        """Host memory the prefix store may take (0: no store)."""
        return self.store.capacity if self.store is not None else 0

    def take(self, engine: Engine, slot: int, prompt: Sequence[int]) -> int:
        """Make `slot` hold the longest prefix of the prompt that a slot or the store holds,
        all but its last token at most (whose logits the caller needs: it feeds at least that
        one), and return its length. What the slot held past it is kept in the store first,
        then released (its memory given back, see `Engine.release`)."""
        wanted = prompt[: len(prompt) - 1]
        found = {s: shared_length(engine.held(s), wanted) for s in range(engine.slots)}
        source = max(found, key=lambda s: (found[s], s == slot))  # the own slot on a tie
        stored = self.store.find(engine, wanted) if self.store is not None else []
        if stored and len(stored) * self.store.block > found[source]:
            return self._restore(engine, slot, stored, found[slot])
        copied = source != slot and self._copy(engine, source, slot, found[source])
        kept = found[source] if copied else found[slot]
        self.spill(engine, slot, kept)
        return kept

    def spill(self, engine: Engine, slot: int, keep: int = 0) -> None:
        """Release all but the slot's first `keep` positions, kept in the store first."""
        if self.store is not None and len(engine.held(slot)) > keep:
            self.store.save(engine, slot)
        engine.release(slot, keep)

    def _copy(self, engine: Engine, source: int, slot: int, length: int) -> bool:
        """Another slot's prefix over this one's, kept in the store first; False where the
        engine cannot copy (the slot is then as it was)."""
        if self.store is not None:
            self.store.save(engine, slot)
        return engine.copy_prefix(source, slot, length)

    def _restore(self, engine: Engine, slot: int, stored: list[Block], own: int) -> int:
        """The stored blocks into the slot, after the whole ones it holds already."""
        size = self.store.block
        kept = min(own // size, len(stored))
        self.spill(engine, slot, kept * size)
        for block in stored[kept:]:
            engine.write_positions(slot, block.tokens, block.data)
        return len(stored) * size


def take_slot(engine: Engine, slot: int, prompt: Sequence[int], cache: PromptCache | None) -> int:
    """Start a slot for this prompt from what the cache offers (None: empty, for benchmarks
    measuring prefill); returns the prompt tokens it holds."""
    if cache is None:
        engine.release(slot)
        return 0
    return cache.take(engine, slot, prompt)


def choose_slot(
    engine: Engine,
    prompt: Sequence[int],
    free: Sequence[int],
    active: Sequence[int],
    released: Mapping[int, int],
) -> int:
    """The free slot a new request takes: the one holding more of its prompt than taking it
    would lose (its own conversation, kept in place), else the one released longest ago
    (`released`: slot -> when; a slot never released first), whose prefix, if any, can still
    be copied from elsewhere. Never one that widens the span of slots a round covers beyond
    what the lowest free slot does (`active`: the slots in use): a gap costs a padding row."""
    lowest = min(free)
    if active:
        low, high = min(active), max(active)
        span = max(high, lowest) - min(low, lowest)
        free = [s for s in free if max(high, s) - min(low, s) <= span]
    wanted = prompt[: len(prompt) - 1]
    shared = {s: shared_length(engine.held(s), wanted) for s in free}
    own = max(free, key=lambda s: (shared[s], -s))
    if shared[own] and shared[own] >= len(engine.held(own)) - shared[own]:
        return own
    return min(free, key=lambda s: (released.get(s, -1), s))
