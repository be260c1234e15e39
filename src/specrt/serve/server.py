"""uvicorn for `specrt serve`: request ids in the log, and a shutdown that drains.

A stopping server must not cut streams silently: uvicorn on its own waited its 30 s, cancelled
the streams' tasks and exited, and each client saw its stream close mid-answer, with no
finish_reason, no error and no `[DONE]`, which a client cannot tell from a finished answer.
What a service behind a load balancer or Kubernetes needs instead, on SIGTERM or Ctrl-C:

1. stop admitting: a new request gets a 503 with Retry-After, and /health answers 503
   "draining", so the balancer takes this replica out; the socket stays open meanwhile, so
   late arrivals get that answer and not a refused connection;
2. let the requests in flight finish, up to `--drain-timeout` (25 s, under Kubernetes' usual
   30 s grace);
3. then end what still runs after its round in flight: a stream gets a last chunk with
   finish_reason "shutdown", an OpenAI error event and `[DONE]`; a plain request a 503;
4. exit with status 0, once those last words are written.

A second signal ends at once. The signal handler only sets a flag; the server's tick (ten a
second, on the event loop) does the work, so nothing takes a lock inside a signal handler.
"""

from __future__ import annotations

import logging
import time

import uvicorn

from specrt.serve.app import create_app
from specrt.serve.request_ids import log_config
from specrt.serve.service import LocalService
from specrt.serve.settings import ServeSettings

log = logging.getLogger("specrt.serve")

LAST_WORDS = 3.0  # seconds before the drain timeout when what still runs is ended


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: LocalService, drain_timeout: float):
        super().__init__(config)
        self.service, self.drain_timeout = service, drain_timeout
        self.signalled = 0
        self._since: float | None = None  # when the drain began
        self._ended = False  # what still ran was told to end

    def handle_exit(self, sig, frame) -> None:
        """The first signal drains, the second forces the exit. (uvicorn's own handler also
        keeps the signal to raise again after shutdown, which ends the process by that signal
        instead of with status 0.)"""
        self.signalled += 1
        if self.signalled > 1:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signalled and not self.should_exit:
            self._drain()
        return await super().on_tick(counter)

    def _drain(self) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
            self.service.drain()
            log.info("draining: no new requests; those in flight get %gs", self.drain_timeout)
        deadline = self._since + self.drain_timeout
        last_words = min(LAST_WORDS, self.drain_timeout / 4)
        if not self._ended and not self.service.idle and now >= deadline - last_words:
            self._ended = True
            self.service.end()
            log.info("draining: the time is up; ending the requests still running")
        if self.service.idle or now >= deadline:
            # uvicorn now waits for the responses to be written, in what is left of the time
            self.config.timeout_graceful_shutdown = max(1, round(deadline - now))
            self.should_exit = True


def run(settings: ServeSettings, log_level: str = "info") -> None:
    """Serve until a signal, then drain (see the module's docstring) and return."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        log_config=log_config(log_level),
    )
    DrainingServer(config, app.state.service, settings.drain_timeout).run()
