"""The one thread that owns the engines, and the bounded FIFO in front of it.

The scheduling seam: the app builds a `Job` (a validated generation plus the channel its
events go to), `submit`s it, and reads `Delta`, `Done` or `Failed` events from the job until
one of the last two. Today the worker runs one generation at a time, to its end; a batched
scheduler takes the same jobs and emits the same events, so the app does not change.

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
from dataclasses import dataclass

from specrt.errors import SpecrtError
from specrt.runtime import Generation, Result
from specrt.serve.errors import APIError
from specrt.serve.metrics import Metrics

log = logging.getLogger("specrt.serve")


@dataclass
class Delta:
    text: str


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
    def __init__(self, max_queue: int, metrics: Metrics):
        self.max_queue, self.metrics = max_queue, metrics
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._running: Job | None = None
        self.failure: str | None = None  # set when an engine call fails unexpectedly
        self._service_seconds = 1.0  # recent time per request, for Retry-After
        self._thread = threading.Thread(target=self._run, name="specrt-engines", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="unavailable")
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected.inc()
                wait = max(1, round(self._service_seconds * (1 + len(self._waiting))))
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
        """Refuse queued jobs, stop the running one after its round, and join the thread."""
        with self._cond:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            running = self._running
        for job in pending:
            job.emit(Failed(APIError(503, "the server is shutting down", code="unavailable")))
        if running:
            running.cancel("cancelled")
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job = self._waiting.popleft()
            self.metrics.waiting.set(len(self._waiting))
            self._running = job
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            self.metrics.running.set(1)
            try:
                self._serve(job)
            finally:
                self._running = None
                self.metrics.running.set(0)

    def _serve(self, job: Job) -> None:
        generation = job.generation
        job.queue_seconds = time.monotonic() - job.arrived
        if generation.deadline is not None and time.monotonic() >= generation.deadline:
            message = f"the request waited {job.queue_seconds:.1f}s in the queue, past its timeout"
            job.emit(Failed(APIError(504, message, code="timeout")))
            return
        try:
            generation.request.load = self.depth
            for delta in generation:
                job.emit(Delta(delta))
                generation.request.load = self.depth  # read again by the next round's policy
        except SpecrtError as err:
            job.emit(Failed(APIError.from_specrt(err)))
            return
        except Exception as err:  # an engine failed: report it, and mark the server unhealthy
            log.exception("generation failed")
            self.failure = f"{type(err).__name__}: {err}"
            job.emit(Failed(APIError(500, f"the engines failed: {self.failure}", code="engine")))
            return
        result = generation.result
        self._service_seconds = 0.7 * self._service_seconds + 0.3 * result.stats.total_seconds
        self.metrics.record(result, job.queue_seconds)
        job.emit(Done(result))
