"""Continuous batching over the engines' slots.

Generations wait in FIFO order and join between rounds, each into a free slot; a joining
prompt runs as calls of its own (prefill), not padded into the round: prompts are hundreds of
tokens and a round's rows a few, so one long prompt in the batch would pad every row to its
length. While others are running, a prompt is fed in chunks of at most `chunk` tokens a step,
and steps alternate between a chunk and a round: a long prompt joining then stalls the running
generations for one chunk's time at most instead of its whole prefill (chunk None, or nothing
running: every prompt whole in one step, before the next round). A generation leaves as soon as its
output ends, freeing its slot for the next. The scheduler knows no HTTP and no threads: the
API drives it for one request, the server's worker thread for many.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from specrt.engines.base import Engine
from specrt.runtime.costs import StepCosts
from specrt.runtime.generation import Generation
from specrt.runtime.prompt_cache import choose_slot
from specrt.runtime.speculative import Request, prefill, speculate, start

PREFILL_CHUNK = 128  # prompt tokens a step feeds (docs/batching.md: what it costs, what it saves)


@dataclass
class Step:
    moved: list[Generation]  # new tokens, or ended (their `result` is set)
    batch: int  # requests in the round run (0: the step fed prompts instead)


class Scheduler:
    def __init__(
        self,
        target: Engine,
        costs: StepCosts,
        slots: int = 1,
        chunk: int | None = PREFILL_CHUNK,
    ):
        if slots > target.slots:
            raise ValueError(f"{slots} slots asked of an engine that holds {target.slots}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"a prefill chunk must be at least 1 token, got {chunk}")
        self.target, self.costs, self.slots, self.chunk = target, costs, slots, chunk
        self.waiting: deque[Generation] = deque()
        self.prefilling: deque[Generation] = deque()  # in a slot, their prompt partly fed
        # The head of `prefilling` once its slot is set up: only the head is fed, and its slot is
        # set up at its first chunk, so that a prompt fed before it can be reused.
        self._head: Generation | None = None
        self.running: dict[int, Generation] = {}  # by slot
        self._fed_last = False  # the last step fed prompts: a round goes next
        self._released: dict[int, int] = {}  # slot -> when its last generation ended
        self._clock = itertools.count(1)

    @property
    def active(self) -> int:
        """Generations holding a slot."""
        return len(self.running) + len(self.prefilling)

    @property
    def busy(self) -> bool:
        """Generations are waiting or holding a slot."""
        return bool(self.waiting) or self.active > 0

    @property
    def has_room(self) -> bool:
        return self.active + len(self.waiting) < self.slots

    def add(self, generation: Generation) -> None:
        self.waiting.append(generation)

    def step(self) -> Step:
        """Seat waiting generations in free slots; then feed prompts or run one round, in turn
        while both are due."""
        seated = self._seat()
        if self.prefilling and not (self.running and self._fed_last):
            self._fed_last = True
            return Step(seated + self._feed(), 0)
        self._fed_last = False
        if self.running:
            step = self._round()
            return Step(seated + step.moved, step.batch)
        return Step(seated, 0)

    def _seat(self) -> list[Generation]:
        """Waiting generations into free slots (those interrupted meanwhile end here)."""
        ended = []
        while self.waiting and self.active < self.slots:
            generation = self.waiting.popleft()
            reason = generation.interrupted()
            if reason:
                generation.close(reason)
                ended.append(generation)
                continue
            generation.request.slot = self._free_slot(generation.request)
            generation.begin()
            self.prefilling.append(generation)
        return ended

    def _free_slot(self, request: Request) -> int:
        """The lowest free slot, or with the prompt cache on, the one that keeps the most for
        later requests (see prompt_cache.choose_slot)."""
        active = [g.request.slot for g in self.prefilling] + list(self.running)
        free = sorted(set(range(self.slots)) - set(active))
        if not request.reuse_prompt:
            return free[0]
        return choose_slot(self.target, request.prompt, free, active, self._released)

    def _release(self, generation: Generation) -> None:
        """It ended: its slot is free, and the tokens it leaves there are the newest."""
        self._released[generation.request.slot] = next(self._clock)

    def _feed(self) -> list[Generation]:
        """Prompt tokens in FIFO order, up to `chunk` while others are running (with none
        running there is no stall to bound, and every prompt goes whole); a prompt fed whole
        gets its first token and starts running."""
        moved, budget = [], self.chunk if self.running else None
        while self.prefilling and (budget is None or budget > 0):
            generation = self.prefilling[0]
            request = generation.request
            reason = generation.interrupted()
            if reason:
                self.prefilling.popleft()
                generation.close(reason)
                self._release(generation)
                moved.append(generation)
                continue
            if generation is not self._head:
                generation.stats.cached_tokens = start(request, self.target)
                self._head = generation
            left = len(request.prompt) - self.target.lengths[request.slot]
            take = left if budget is None else min(left, budget)
            started = time.perf_counter()
            first = prefill(request, self.target, take)
            generation.stats.prefill_seconds += time.perf_counter() - started
            budget = None if budget is None else budget - take
            if first is None:
                break
            self.prefilling.popleft()
            generation.stats.target_calls += 1  # the prefill counts as one, however cut
            generation.absorb([first[0]], logprobs=first[1])
            moved.append(generation)
            if generation.stopped:
                generation.close()
                self._release(generation)
            else:
                self.running[request.slot] = generation
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
        self._release(generation)
        del self.running[generation.request.slot]
