"""Prompt reuse: a new sequence starts from what a slot's cache already holds of its prompt.

A chat's next turn resends the whole conversation, n choices send one prompt n times, and a
service's requests share its system prompt; on a CPU a prompt costs as much time as a few
dozen output tokens per hundred. So before a prefill the longest prefix of the prompt that any
slot holds is kept: in place where it is the request's own slot (a rollback), copied where it
is another's, and only the rest is fed. Which free slot a request takes decides what survives
for later requests: its own conversation's slot where one is free, else the one released
longest ago (`choose_slot`), as llama-server picks its slots by similarity and then age.

This changes no output. Reused keys and values were computed by other calls (a prefill cut
elsewhere, a verify round beside other rows), and the engines already guarantee that a
position's numbers depend on neither how calls are cut nor their neighbours: that is what lets
a verify call reproduce one-token decoding (see docs/batching.md, "Batch invariance").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specrt.engines.base import Engine


def shared_length(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens the two have in common."""
    n = min(len(held), len(tokens))
    for i in range(n):
        if held[i] != tokens[i]:
            return i
    return n


def take_slot(engine: Engine, slot: int, prompt: Sequence[int], reuse: bool = True) -> int:
    """Make `slot` hold the longest prefix of the prompt that a slot of the engine holds, all
    but its last token at most (whose logits the caller needs: it feeds at least that one), and
    return its length; with reuse off (benchmarks measuring prefill), start the slot empty.
    What the slot held past that prefix is released (its memory given back, see
    `Engine.release`): a slot's cache follows the sequence it now serves."""
    kept = 0
    if reuse:
        wanted = prompt[: len(prompt) - 1]
        found = {s: shared_length(engine.held(s), wanted) for s in range(engine.slots)}
        source = max(found, key=lambda s: (found[s], s == slot))  # the own slot on a tie
        copied = source != slot and engine.copy_prefix(source, slot, found[source])
        kept = found[source] if copied else found[slot]
    engine.release(slot, kept)
    return kept


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
