"""The one thread that owns the engines, stepping the runtime's scheduler.

The service wraps each request's `Sequence` in a `Job` (the channel its events go to) and
`submit`s it: the sequence goes straight into the scheduler's bounded queue, the only queue
(`Busy` when it is full). The worker thread steps the scheduler while it has work (continuous
batching: up to --max-batch sequences advance together, round by round) and turns each step's
progress into `Delta`, `Done` or `Failed` events. Deadlines and cancellation are the
scheduler's: a cancel is the sequence's flag, and the step ends it.

Engine calls never run on the event loop: the worker is an ordinary thread, and events cross to
the loop through `call_soon_threadsafe`. A job's channel is unbounded (a generation's output is
bounded by its token budget), so a slow reader never stalls the engines for everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from specrt.errors import Busy, EngineFailure, SpecrtError, TimedOut, Unavailable
from specrt.runtime import Scheduler, Sequence, SpeculativeRuntime
from specrt.runtime.budget import KVBudget
from specrt.serve.errors import APIError
from specrt.serve.events import Delta, Done, Event, Failed
from specrt.serve.metrics import Metrics
from specrt.serve.render import Shape
from specrt.serve.request_ids import REQUEST_ID

log = logging.getLogger("specrt.serve")


def shutting_down() -> Unavailable:
    """What a request is told when the server stops before it could run: go elsewhere (a
    load balancer's other replicas) and come back in a second."""
    error = Unavailable(
        "the server is shutting down: retry, another replica will serve it",
        code="shutting_down",
    )
    error.retry_after = 1
    return error


class Job:
    """One request's channel out of the worker, and the app's `Stream` of it (service.py);
    created on the event loop, in the request's task (it takes the request's id along)."""

    headers: dict[str, str] = {}

    def __init__(self, sequence: Sequence, shape: Shape | None = None):
        self.sequence = sequence
        self.shape = shape or Shape()  # how its text is parsed (thought, tool calls)
        self.request_id = REQUEST_ID.get()  # for the worker's log lines
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next(self) -> Event:
        return await self.events.get()

    def cancel(self) -> None:
        """Ended at the scheduler's next step (withdrawn if still queued); nothing once it
        has ended."""
        self.sequence.cancel()


class Worker:
    def __init__(
        self,
        runtime: SpeculativeRuntime,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        budget: KVBudget | None = None,
    ):
        self.metrics = metrics
        self.scheduler = Scheduler(
            runtime.target, runtime.costs, max_batch, runtime.prefill_chunk, max_queue, budget
        )
        self._jobs: dict[Sequence, Job] = {}  # submitted, not yet ended
        self._cond = threading.Condition()
        self._closed = False
        self._draining = False  # shutting down: what was admitted runs, nothing more is
        self.failure: str | None = None  # set when an engine call fails unexpectedly
        self._service_seconds = 1.0  # recent time per request, for Retry-After
        self._thread = threading.Thread(target=self._run, name="specrt-engines", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting for a slot."""
        return self.scheduler.depth

    @property
    def idle(self) -> bool:
        """No request is queued or running."""
        with self._cond:
            return not self._jobs

    def submit(self, job: Job) -> None:
        """Queue a job's sequence: `Unavailable` once draining or closed, `Busy` when the
        queue is full."""
        with self._cond:
            if self._draining or self._closed:
                raise shutting_down()
            try:
                self.scheduler.add(job.sequence)
            except Busy as err:
                self.metrics.rejected.inc()
                turns = (1 + self.scheduler.depth) / self.scheduler.slots
                err.retry_after = max(1, round(self._service_seconds * turns))
                raise
            self._jobs[job.sequence] = job
            self.metrics.waiting.set(self.scheduler.depth)
            self._cond.notify()

    def drain(self) -> None:
        """Admit no more requests; those admitted run on (`end` stops them)."""
        with self._cond:
            self._draining = True

    def end(self) -> None:
        """Stop every request after the round in flight: a running one finishes with
        finish_reason "shutdown" (its stream's last chunk says so), a queued one fails
        with a 503."""
        with self._cond:
            for sequence in self._jobs:
                sequence.cancel("shutdown")
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """End every request (`end`), and join the thread once they have ended."""
        self.end()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.scheduler.busy:
                    self._cond.wait()
                if not self.scheduler.busy:
                    return  # closed, and every job has ended
            try:
                step = self.scheduler.step()
            except Exception as err:
                self._fail(err)
                continue
            self.metrics.running.set(self.scheduler.active)
            self.metrics.waiting.set(self.scheduler.depth)
            if step.batch:
                self.metrics.batch_size.observe(step.batch)
            for sequence in step.moved:
                self._report(sequence)

    def _report(self, sequence: Sequence) -> None:
        job = self._jobs[sequence]
        delta, logprobs = sequence.take(), sequence.take_logprobs()
        if delta or logprobs:
            job.emit(Delta(delta, logprobs))
        result = sequence.result
        if result is None:
            return
        with self._cond:
            del self._jobs[sequence]
        if sequence.slot is None:  # it ended in the queue, before it started
            self._unstarted(job)
            return
        seconds = result.stats.total_seconds
        self._service_seconds = 0.7 * self._service_seconds + 0.3 * seconds
        self.metrics.record(result, sequence.queue_seconds)
        stats = result.stats
        log.info(
            "finished (%s): %d prompt tokens (%d cached), %d new in %.2f s after %.2f s queued",
            result.finish_reason,
            stats.prompt_tokens,
            stats.cached_tokens,
            stats.new_tokens,
            seconds,
            sequence.queue_seconds,
            extra={"request_id": job.request_id},
        )
        job.emit(Done(result))

    def _unstarted(self, job: Job) -> None:
        """A queued request that timed out (504), was refused at shutdown (503), or whose
        client left (counted; nobody listens)."""
        sequence = job.sequence
        if sequence.result.finish_reason == "timeout":
            message = (
                f"the request waited in the queue past the server's timeout of "
                f"{sequence.timeout:g}s"
            )
            job.emit(Failed(APIError.from_specrt(TimedOut(message, code="timeout"))))
        elif sequence.result.finish_reason == "shutdown":
            job.emit(Failed(APIError.from_specrt(shutting_down())))
        else:
            self.metrics.outcome("cancelled")

    def _fail(self, err: Exception) -> None:
        """A step failed: every request on the engines fails with it, and the slots start
        afresh (queued requests stay queued). A SpecrtError is the request's fault; anything
        else marks the server unhealthy."""
        if not isinstance(err, SpecrtError):
            log.exception("generation failed")
            self.failure = f"{type(err).__name__}: {err}"
            err = EngineFailure(f"the engines failed: {self.failure}", code="engine")
        error = APIError.from_specrt(err)
        for sequence in self.scheduler.reset():
            with self._cond:
                job = self._jobs.pop(sequence)
            log.info("failed: %s", error.message, extra={"request_id": job.request_id})
            job.emit(Failed(error))
        self.metrics.running.set(0)
