"""The engine step: sequences in (`add`), one step of work at a time (`step`), out when done.

Every caller drives generation through this one object: the Python API for one sequence, the
server's worker thread and the load benchmark for many. A step reads like nano-vllm's: look at
interruptions, seat, then feed prompts or run one round, and report the sequences that moved.

- **One queue.** Sequences wait in FIFO order in `waiting`, bounded by `max_queue` beyond the
  free slots (a server's --max-queue: `add` refuses with `Busy` past it); they are seated
  between rounds, each in a free slot.
- **A KV budget** (optional, `budget.py`): a sequence is seated only where the cache positions
  it may need fit beside the seated ones'; idle slots give their memory back to make room.
- **One place for deadlines and cancellation.** At the start of every step, each sequence past
  its deadline or cancelled ends (`_interrupt`): a waiting one without ever taking a slot, a
  running one after the round in flight. `abort` (or `Sequence.cancel`, from any thread) only
  sets its flag.
- **Prompts apart from rounds.** A joining prompt runs as calls of its own (prefill), not
  padded into the round: prompts are hundreds of tokens and a round's rows a few. While others
  are running, a prompt is fed in chunks of at most `chunk` tokens a step, and steps alternate
  between a chunk and a round: a long prompt joining then stalls the running sequences for one
  chunk's time at most (chunk None, or nothing running: every prompt whole in one step, before
  the next round). A sequence leaves as soon as its output ends, freeing its slot.

The scheduler knows no HTTP and no threads beyond the lock that lets another thread `add`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from specrt.engines.base import Engine
from specrt.errors import Busy
from specrt.runtime.budget import KVBudget
from specrt.runtime.costs import StepCosts
from specrt.runtime.prompt_cache import choose_slot
from specrt.runtime.sequence import RUNNING, Sequence
from specrt.runtime.speculative import prefill, speculate, start

PREFILL_CHUNK = 128  # prompt tokens a step feeds (docs/batching.md: what it costs, what it saves)


@dataclass
class Step:
    moved: list[Sequence]  # new tokens, or ended (their `result` is set)
    batch: int  # sequences in the round run (0: the step fed prompts instead)


class Scheduler:
    def __init__(
        self,
        target: Engine,
        costs: StepCosts,
        slots: int = 1,
        chunk: int | None = PREFILL_CHUNK,
        max_queue: int | None = None,
        budget: KVBudget | None = None,
    ):
        if slots > target.slots:
            raise ValueError(f"{slots} slots asked of an engine that holds {target.slots}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"a prefill chunk must be at least 1 token, got {chunk}")
        self.target, self.costs, self.slots, self.chunk = target, costs, slots, chunk
        self.max_queue = max_queue  # sequences waiting beyond the free slots (None: no bound)
        self.budget = budget  # cache positions the slots may hold at once (None: every slot full)
        self.waiting: deque[Sequence] = deque()
        self._lock = threading.Lock()  # `add` may come from another thread than `step`
        self.prefilling: deque[Sequence] = deque()  # in a slot, their prompt partly fed
        # The head of `prefilling` once its slot is set up: only the head is fed, and its slot is
        # set up at its first chunk, so that a prompt fed before it can be reused.
        self._head: Sequence | None = None
        self.running: dict[int, Sequence] = {}  # by slot
        self._fed_last = False  # the last step fed prompts: a round goes next
        self._released: dict[int, int] = {}  # slot -> when its last sequence ended
        self._clock = itertools.count(1)

    @property
    def active(self) -> int:
        """Sequences holding a slot."""
        return len(self.running) + len(self.prefilling)

    @property
    def busy(self) -> bool:
        """Sequences are waiting or holding a slot."""
        return bool(self.waiting) or self.active > 0

    @property
    def has_room(self) -> bool:
        """A sequence added now would be seated at the next step."""
        return self.active + len(self.waiting) < self.slots

    @property
    def depth(self) -> int:
        """Sequences that wait for a slot to free up (not seated at the next step)."""
        return max(0, self.active + len(self.waiting) - self.slots)

    def add(self, sequence: Sequence) -> None:
        """Queue it (from any thread); `Busy` where max_queue are already waiting, an error
        where it could never fit the KV budget."""
        if self.budget is not None:
            self.budget.check(sequence)
        with self._lock:
            if self.max_queue is not None and self.depth >= self.max_queue:
                raise Busy(
                    f"the server is busy: {self.depth} requests are waiting "
                    f"(--max-queue {self.max_queue}); retry later",
                    code="queue_full",
                )
            self.waiting.append(sequence)

    def abort(self, sequence: Sequence, reason: str = "cancelled") -> None:
        """End it at the next step (from any thread)."""
        sequence.cancel(reason)

    def step(self) -> Step:
        """End the interrupted; seat waiting sequences in free slots; then feed prompts or run
        one round, in turn while both are due."""
        moved = self._interrupt()
        self._seat()
        if self.prefilling and not (self.running and self._fed_last):
            self._fed_last = True
            return Step(moved + self._feed(), 0)
        self._fed_last = False
        if self.running:
            step = self._round()
            return Step(moved + step.moved, step.batch)
        return Step(moved, 0)

    def reset(self) -> list[Sequence]:
        """An engine call failed: give up the sequences holding a slot (returned, unfinished)
        and start the slots afresh; waiting ones stay queued."""
        lost = [*self.prefilling, *self.running.values()]
        self.prefilling.clear()
        self.running.clear()
        self._head, self._fed_last = None, False
        return lost

    def _interrupt(self) -> list[Sequence]:
        """The one place deadlines and cancellations take effect: a waiting sequence leaves the
        queue, a seated one its slot, each ended with the reason."""
        with self._lock:
            ended = [(s, s.interrupted()) for s in self.waiting]
            ended = [(s, reason) for s, reason in ended if reason]
            for sequence, _ in ended:
                self.waiting.remove(sequence)
        for sequence in [*self.prefilling, *self.running.values()]:
            reason = sequence.interrupted()
            if reason:
                self._leave(sequence)
                ended.append((sequence, reason))
        for sequence, reason in ended:
            sequence.finish(reason)
        return [sequence for sequence, _ in ended]

    def _seat(self) -> None:
        """Waiting sequences into free slots, in order, while the KV budget has room."""
        with self._lock:
            while self.waiting and self.active < self.slots:
                sequence = self.waiting[0]
                slot = self._free_slot(sequence)
                if not self._fits(sequence, slot):
                    break  # it waits for a seated sequence to end
                self.waiting.popleft()
                sequence.seat(slot)
                self.prefilling.append(sequence)

    def _fits(self, sequence: Sequence, slot: int) -> bool:
        """Whether the KV budget has room for it in this slot beside what the seated may need;
        idle slots give back what they hold, the one released longest ago first, as far as
        that takes (see budget.py)."""
        if self.budget is None:
            return True
        seated = [*self.prefilling, *self.running.values()]
        reserved = sum(map(self.budget.need, [*seated, sequence]))
        busy = {s.slot for s in seated} | {slot}
        idle = [s for s in range(self.target.slots) if s not in busy]
        idle.sort(key=lambda s: self._released.get(s, 0))
        return self.budget.make_room(reserved, idle, sequence.prompt_cache)

    def _free_slot(self, sequence: Sequence) -> int:
        """The lowest free slot, or with the prompt cache on, the one that keeps the most for
        later sequences (see prompt_cache.choose_slot)."""
        active = [s.slot for s in self.prefilling] + list(self.running)
        free = sorted(set(range(self.slots)) - set(active))
        if sequence.prompt_cache is None:
            return free[0]
        return choose_slot(self.target, sequence.prompt, free, active, self._released)

    def _leave(self, sequence: Sequence) -> None:
        """It ended or was interrupted: its slot is free, and the tokens it leaves there are
        the newest."""
        if sequence.status == RUNNING:
            del self.running[sequence.slot]
        else:
            self.prefilling.remove(sequence)
            if sequence is self._head:
                self._head = None
        self._released[sequence.slot] = next(self._clock)

    def _feed(self) -> list[Sequence]:
        """Prompt tokens in FIFO order, up to `chunk` while others are running (with none
        running there is no stall to bound, and every prompt goes whole); a prompt fed whole
        gets its first token and starts running."""
        moved, budget = [], self.chunk if self.running else None
        while self.prefilling and (budget is None or budget > 0):
            sequence = self.prefilling[0]
            if sequence is not self._head:
                sequence.stats.cached_tokens = start(sequence, self.target)
                self._head = sequence
            left = len(sequence.prompt) - self.target.lengths[sequence.slot]
            take = left if budget is None else min(left, budget)
            started = time.perf_counter()
            first = prefill(sequence, self.target, take)
            sequence.stats.prefill_seconds += time.perf_counter() - started
            budget = None if budget is None else budget - take
            if first is None:
                break
            self.prefilling.popleft()
            self._head = None
            sequence.stats.target_calls += 1  # the prefill counts as one, however cut
            sequence.emit(1, logprobs=first[1])
            moved.append(sequence)
            sequence.status = RUNNING
            self.running[sequence.slot] = sequence
            if sequence.stopped:
                self._end(sequence)
        return moved

    def _round(self) -> Step:
        moved = [self.running[slot] for slot in sorted(self.running)]
        capacity = self.target.capacity
        for sequence in moved:
            if sequence.room(capacity) < 0:
                self._end(sequence)  # the context is full
        active = [s for s in moved if s.result is None]
        if active:
            step = speculate(active, self.target, self.costs)
            for i, sequence in enumerate(active):
                sequence.stats.record(step, i)
                sequence.emit(len(step.emitted[i]), step.origins(i), step.logprobs[i])
                if sequence.stopped:
                    self._end(sequence)
        return Step(moved, len(active))

    def _end(self, sequence: Sequence) -> None:
        self._leave(sequence)
        sequence.finish()
