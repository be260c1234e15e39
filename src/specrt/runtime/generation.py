"""What `SpeculativeRuntime.stream` hands the user: a thin view over one `Sequence`.

Iterating it serves the sequence alone (a batch of one, its prompt whole) through an engine
step of its own, yielding text as it comes; `result` is set once it ends. The view holds the
sequence and that step, nothing of the runtime: every piece of state is on the sequence.
"""

from __future__ import annotations

from collections.abc import Iterator

from specrt.runtime.scheduler import Scheduler
from specrt.runtime.sequence import Result, Sequence, Stats


class Generation:
    """Iterate for text deltas; `.result` is set once it ends.

    Iterating drives the engines, so it belongs to one thread at a time. `cancel` may be called
    from any thread: the generation ends after the round in flight, with that finish reason.
    """

    def __init__(self, sequence: Sequence, scheduler: Scheduler):
        self.sequence, self._scheduler = sequence, scheduler

    def __iter__(self) -> Iterator[str]:
        sequence, scheduler = self.sequence, self._scheduler
        scheduler.add(sequence)
        while sequence.result is None:
            scheduler.step()
            delta = sequence.take()
            if delta:
                yield delta

    def cancel(self, reason: str = "cancelled") -> None:
        self.sequence.cancel(reason)

    @property
    def result(self) -> Result | None:
        return self.sequence.result

    @property
    def stats(self) -> Stats:
        return self.sequence.stats
