"""The OpenAI-compatible app: `create_app(settings)` builds it, `run(settings)` serves it.

A request is validated in three steps, each in one place: pydantic checks the body's types and
shapes, `refuse_unsupported` refuses options specrt does not implement, and the runtime checks
values while it builds the generation (tokenizing off the event loop). Only then is a job
queued, so every bad request gets a 4xx and never reaches the engines. A streamed reply awaits
its first event before answering, so a request that times out in the queue, or fails at once,
still gets an error status instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.runtime import Generation, Result, SpeculativeRuntime
from specrt.runtime.drafters import DRAFTERS
from specrt.serve import errors
from specrt.serve.auth import BearerAuth
from specrt.serve.errors import APIError
from specrt.serve.metrics import Metrics
from specrt.serve.protocol import ChatRequest, CompletionRequest, Reply
from specrt.serve.settings import ServeSettings
from specrt.serve.worker import Delta, Done, Event, Failed, Job, Worker

log = logging.getLogger("specrt.serve")


class Server:
    """What the routes share: the settings, the runtime once loaded, the worker, the metrics."""

    def __init__(self, settings: ServeSettings, runtime: SpeculativeRuntime | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.runtime = runtime
        self.worker: Worker | None = None
        self.load_error: str | None = None

    def start(self) -> None:
        """Load the engines (and calibrate) in the background; /health says when it is done."""
        if self.runtime is not None:
            self.worker = self._worker(self.runtime)
            return
        threading.Thread(target=self._load, name="specrt-load", daemon=True).start()

    def _load(self) -> None:
        s = self.settings
        try:
            slots = s.max_batch if s.backend.startswith("onnxruntime") else 1
            if slots > 1 and not Bundle.load(s.bundle).per_row_positions:
                log.warning(
                    "%s was built before per-row cache positions: serving one request at a "
                    "time; rebuild it with this specrt to batch",
                    s.bundle,
                )
                slots = 1
            runtime = SpeculativeRuntime.load(
                s.bundle, backend=s.backend, calibrate=s.calibrate, threads=s.threads, slots=slots
            )
        except Exception as err:  # reported by /health and every route, not a dead thread
            self.load_error = f"{type(err).__name__}: {err}"
            return
        self.worker = self._worker(runtime)
        self.runtime = runtime

    def _worker(self, runtime: SpeculativeRuntime) -> Worker:
        batch = min(self.settings.max_batch, runtime.slots)
        return Worker(runtime, batch, self.settings.max_queue, self.metrics)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def health(self) -> tuple[str, dict]:
        if self.load_error:
            return "error", {"detail": f"the bundle could not be loaded: {self.load_error}"}
        if self.runtime is None or self.worker is None:
            return "loading", {"detail": "loading and calibrating the engines"}
        if self.worker.failure:
            return "error", {"detail": f"the engines failed: {self.worker.failure}"}
        return "ok", {"model": self.settings.served_model, "waiting": self.worker.depth}

    def ready(self) -> tuple[SpeculativeRuntime, Worker]:
        status, detail = self.health()
        if status != "ok":
            raise APIError(503, f"the server is not ready: {detail['detail']}", code=status)
        return self.runtime, self.worker

    def model_card(self) -> dict:
        card = {"id": self.settings.served_model, "object": "model", "owned_by": "specrt"}
        if self.runtime is not None:
            bundle = self.runtime.bundle
            card |= {
                "max_model_len": bundle.max_context,
                "k_max": bundle.max_draft,
                "precision": bundle.precision_label,
                "drafters": list(DRAFTERS) if bundle.has_draft else ["ngram"],
            }
        return card

    def generation(self, body: CompletionRequest | ChatRequest) -> Generation:
        """The runtime's generation for a request (tokenizes: call it off the event loop)."""
        runtime, limit = self.runtime, body.token_limit
        prompt_field = "messages" if isinstance(body, ChatRequest) else "prompt"
        try:
            ids = runtime.encode(body.prompt_input())
            room = runtime.bundle.max_context - len(ids)
            if limit is not None and limit > room:
                raise APIError(
                    400,
                    f"the prompt has {len(ids)} tokens and max_tokens asks for {limit} more; the "
                    f"model's context is {runtime.bundle.max_context} tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            return runtime.stream(
                ids,
                max_new_tokens=min(limit or body.default_max_tokens or room, room),
                timeout=self.settings.timeout,
                **body.runtime_options(self.settings.controller, self.settings.drafter),
            )
        except SpecrtError as err:
            raise APIError.from_specrt(err, prompt_field) from err

    async def respond(self, body: CompletionRequest | ChatRequest, request: Request) -> Response:
        _, worker = self.ready()
        body.refuse_unsupported()
        if body.model and body.model != self.settings.served_model:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist here; this server serves "
                f"{self.settings.served_model!r}",
                param="model",
                code="model_not_found",
            )
        job = Job(await run_in_threadpool(self.generation, body))
        worker.submit(job)
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        streaming = False
        try:
            first = await self._first_event(job)
            reply = Reply(isinstance(body, ChatRequest), self.settings.served_model)
            if body.stream and not isinstance(first, Failed):
                streaming = True  # the stream owns the watcher from here
                events = self._stream(job, first, reply, body.include_usage, watcher)
                return StreamingResponse(events, media_type="text/event-stream")
            return JSONResponse(reply.response(await self._result(job, first)))
        finally:
            if not streaming:
                watcher.cancel()

    async def _first_event(self, job: Job) -> Event:
        """The job's first event; a job still queued at its deadline is withdrawn (504)."""
        deadline = job.generation.deadline
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(job.events.get(), remaining)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            if self.worker.withdraw(job):
                raise APIError(
                    504,
                    f"the request waited in the queue past the server's timeout of "
                    f"{self.settings.timeout:g}s",
                    code="timeout",
                ) from None
            return await job.events.get()  # it started: its own deadline ends it in a round

    async def _result(self, job: Job, event: Event) -> Result:
        while isinstance(event, Delta):
            event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        return event.result

    async def _stream(self, job: Job, event: Event, reply: Reply, include_usage: bool, watcher):
        """Server-sent events as OpenAI sends them, ending with `data: [DONE]`."""
        try:
            while True:
                if isinstance(event, Delta):
                    yield sse(reply.chunk(event.text))
                elif isinstance(event, Done):
                    yield sse(reply.last_chunk(event.result))
                    if include_usage:
                        yield sse(reply.usage_chunk(event.result))
                    break
                else:
                    self.metrics.outcome(errors.outcome(event.error.status))
                    yield sse(event.error.body())
                    break
                event = await job.events.get()
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once done; otherwise the client left mid-stream

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        """Cancel the job when the client goes away: withdrawn if still queued, else stopped
        after the round in flight (and then recorded by the worker as cancelled)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if job.generation.result is None:
            if self.worker.withdraw(job):
                self.metrics.outcome("cancelled")
            job.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def create_app(settings: ServeSettings, runtime: SpeculativeRuntime | None = None) -> FastAPI:
    """The app for one bundle. Pass a loaded runtime to serve it at once (its engines then
    belong to the app's worker thread); otherwise the app loads the bundle when it starts."""
    server = Server(settings, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        yield
        server.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = server
    app.state.metrics = server.metrics
    errors.install(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key, metrics=server.metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, detail = server.health()
        return JSONResponse(
            {"status": status, **detail}, status_code=200 if status == "ok" else 503
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.served_model:
            raise APIError(404, f"the model {model_id!r} does not exist", code="model_not_found")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.respond(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await server.respond(body, request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type=Metrics.content_type)

    return app


def run(settings: ServeSettings, log_level: str = "info") -> None:
    """Serve until interrupted; in-flight requests get 30 s to finish on shutdown."""
    import uvicorn

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
    )
