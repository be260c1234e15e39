"""Continuous batching over the engines' slots.

Generations wait in FIFO order and join between rounds, each into a free slot; a joining
prompt runs as a call of its own (prefill), not padded into the round: prompts are hundreds of
tokens and a round's rows a few, so one long prompt in the batch would pad every row to its
length. A step either admits what fits (so a new request's first token is not held behind a
round) or runs one round for every running generation; a generation leaves as soon as its
output ends, freeing its slot for the next. The scheduler knows no HTTP and no threads: the
API drives it for one request, the server's worker thread for many.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specrt.engines.base import Engine
from specrt.runtime.costs import StepCosts
from specrt.runtime.generation import Generation
from specrt.runtime.speculative import prefill, speculate


@dataclass
class Step:
    moved: list[Generation]  # new tokens, or ended (their `result` is set)
    batch: int  # requests in the round run (0: the step admitted instead)


class Scheduler:
    def __init__(self, target: Engine, costs: StepCosts, slots: int = 1):
        if slots > target.slots:
            raise ValueError(f"{slots} slots asked of an engine that holds {target.slots}")
        self.target, self.costs, self.slots = target, costs, slots
        self.waiting: deque[Generation] = deque()
        self.running: dict[int, Generation] = {}  # by slot

    @property
    def has_room(self) -> bool:
        return len(self.running) + len(self.waiting) < self.slots

    def add(self, generation: Generation) -> None:
        self.waiting.append(generation)

    def step(self) -> Step:
        """Admit waiting generations into free slots, or else run one round."""
        if self.waiting and len(self.running) < self.slots:
            return Step(self._admit(), 0)
        if self.running:
            return self._round()
        return Step([], 0)

    def _admit(self) -> list[Generation]:
        moved = []
        while self.waiting and len(self.running) < self.slots:
            generation = self.waiting.popleft()
            moved.append(generation)
            reason = generation.interrupted()
            if reason:
                generation.close(reason)
                continue
            slot = min(set(range(self.slots)) - set(self.running))
            generation.request.slot = slot
            generation.begin()
            start = time.perf_counter()
            first, logprobs = prefill(generation.request, self.target)
            generation.stats.prefill_seconds = time.perf_counter() - start
            generation.stats.cached_tokens = generation.request.cached
            generation.stats.target_calls += 1
            generation.absorb([first], logprobs=logprobs)
            if generation.stopped:
                generation.close()
            else:
                self.running[slot] = generation
        return moved

    def _round(self) -> Step:
        moved = [self.running[slot] for slot in sorted(self.running)]
        capacity = self.target.capacity
        for generation in moved:
            if generation.request.room(capacity) < 0:
                self._leave(generation)  # the context is full
        active = [g for g in moved if g.result is None]
        if active:
            step = speculate([g.request for g in active], self.target, self.costs)
            for i, generation in enumerate(active):
                generation.stats.record(step, i)
                generation.absorb(step.emitted[i], step.origins(i), step.logprobs[i])
                if generation.stopped:
                    self._leave(generation)
        return Step(moved, len(active))

    def _leave(self, generation: Generation) -> None:
        generation.close()
        del self.running[generation.request.slot]
