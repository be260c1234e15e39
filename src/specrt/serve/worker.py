"""The one thread that owns the engines, and the bounded FIFO in front of it.

The app builds a `Job` (a validated generation plus the channel its events go to), `submit`s
it, and reads `Delta`, `Done` or `Failed` events from the job until one of the last two. The
worker moves queued jobs into the runtime's `Scheduler` whenever it has a free slot (continuous
batching: up to --max-batch requests advance together, round by round) and turns each step's
progress into events.

Engine calls never run on the event loop: the worker is an ordinary thread, and events cross to
the loop through `call_soon_threadsafe`. A job's channel is unbounded (a generation's output is
bounded by its token budget), so a slow reader never stalls the engines for everyone else.
Cancellation (a client that went away, a deadline) takes effect after the round in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specrt.errors import SpecrtError
from specrt.runtime import Generation, Result, Scheduler, SpeculativeRuntime, TokenLogprob
from specrt.serve.errors import APIError
from specrt.serve.metrics import Metrics

log = logging.getLogger("specrt.serve")


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where the request asked


@dataclass
class Done:
    result: Result


@dataclass
class Failed:
    error: APIError


Event = Delta | Done | Failed


class Job:
    """One request on its way through the worker; created on the event loop."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.queue_seconds = 0.0

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self, reason: str = "cancelled") -> None:
        self.generation.cancel(reason)


class Worker:
    def __init__(
        self, runtime: SpeculativeRuntime, max_batch: int, max_queue: int, metrics: Metrics
    ):
        self.runtime, self.max_batch = runtime, max_batch
        self.max_queue, self.metrics = max_queue, metrics
        self.scheduler = self._scheduler()
        self._waiting: deque[Job] = deque()  # submitted, not yet in the scheduler
        self._jobs: dict[Generation, Job] = {}  # in the scheduler
        self._cond = threading.Condition()
        self._closed = False
        self.failure: str | None = None  # set when an engine call fails unexpectedly
        self._service_seconds = 1.0  # recent time per request, for Retry-After
        self._thread = threading.Thread(target=self._run, name="specrt-engines", daemon=True)
        self._thread.start()

    def _scheduler(self) -> Scheduler:
        runtime = self.runtime
        return Scheduler(runtime.target, runtime.costs, self.max_batch, runtime.prefill_chunk)

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="unavailable")
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected.inc()
                turns = (1 + len(self._waiting)) / self.max_batch
                wait = max(1, round(self._service_seconds * turns))
                raise APIError(
                    429,
                    f"the server is busy: {len(self._waiting)} requests are waiting "
                    f"(--max-queue {self.max_queue}); retry later",
                    code="queue_full",
                    headers={"Retry-After": str(wait)},
                )
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue if it has not started; False once it has."""
        with self._cond:
            if job not in self._waiting:
                return False
            self._waiting.remove(job)
            self.metrics.waiting.set(len(self._waiting))
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Refuse queued jobs, stop the running ones after their round, and join the thread."""
        with self._cond:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            running = list(self._jobs.values())
        for job in pending:
            job.emit(Failed(APIError(503, "the server is shutting down", code="unavailable")))
        for job in running:
            job.cancel("cancelled")
        self._thread.join(timeout)

    def _admit(self) -> bool:
        """Move queued jobs into free slots; False once the worker is closed and idle."""
        with self._cond:
            while not self._closed and not self._waiting and not self._jobs:
                self._cond.wait()
            if self._closed and not self._jobs:
                return False
            while self._waiting and self.scheduler.has_room:
                job = self._waiting.popleft()
                job.queue_seconds = time.monotonic() - job.arrived
                deadline = job.generation.deadline
                if deadline is not None and time.monotonic() >= deadline:
                    message = (
                        f"the request waited {job.queue_seconds:.1f}s in the queue, "
                        "past its timeout"
                    )
                    job.emit(Failed(APIError(504, message, code="timeout")))
                    continue
                self.scheduler.add(job.generation)
                self._jobs[job.generation] = job
            self.metrics.waiting.set(len(self._waiting))
            return True

    def _run(self) -> None:
        while self._admit():
            try:
                step = self.scheduler.step()
            except Exception as err:
                self._fail_all(err)
                continue
            self.metrics.running.set(self.scheduler.active)
            if step.batch:
                self.metrics.batch_size.observe(step.batch)
            for generation in step.moved:
                self._report(generation)

    def _report(self, generation: Generation) -> None:
        job = self._jobs[generation]
        delta, logprobs = generation.take(), generation.take_logprobs()
        if delta or logprobs:
            job.emit(Delta(delta, logprobs))
        result = generation.result
        if result is not None:
            with self._cond:
                del self._jobs[generation]
            seconds = result.stats.total_seconds
            self._service_seconds = 0.7 * self._service_seconds + 0.3 * seconds
            self.metrics.record(result, job.queue_seconds)
            job.emit(Done(result))

    def _fail_all(self, err: Exception) -> None:
        """A step failed: every request on the engines fails with it, and the slots start
        afresh. A SpecrtError is the request's fault; anything else marks the server unhealthy."""
        if isinstance(err, SpecrtError):
            error = APIError.from_specrt(err)
        else:
            log.exception("generation failed")
            self.failure = f"{type(err).__name__}: {err}"
            error = APIError(500, f"the engines failed: {self.failure}", code="engine")
        with self._cond:
            failed = list(self._jobs.values())
            self._jobs.clear()
        for job in failed:
            job.emit(Failed(error))
        self.scheduler = self._scheduler()
        self.metrics.running.set(0)
