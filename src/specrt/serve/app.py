"""The OpenAI-compatible app: `create_app(settings)` builds it (server.py's `run` serves it).

The app knows HTTP; a `Service` (service.py) runs the generations, in this process or, under
Ray Serve, in engine replicas. A request is validated in three steps, each in one place:
pydantic checks the body's types and shapes, `refuse_unsupported` refuses options specrt does
not implement, and the runtime checks values while it builds the generation (tokenizing off the
event loop). Only then is a job queued, so every bad request gets a 4xx and never reaches the
engines. A streamed reply awaits
its first event before answering, so a request that times out in the queue, or fails at once,
still gets an error status instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specrt.runtime import Result, SpeculativeRuntime
from specrt.serve import errors
from specrt.serve.auth import BearerAuth
from specrt.serve.body_limit import BodyLimit
from specrt.serve.errors import APIError
from specrt.serve.events import Delta, Done, Event, Failed
from specrt.serve.metrics import Metrics
from specrt.serve.protocol import ChatRequest, CompletionRequest
from specrt.serve.render import Writer
from specrt.serve.request_ids import RequestIds
from specrt.serve.service import LocalService, Service, Stream
from specrt.serve.settings import ServeSettings


class Server:
    """What the routes share: the settings and the service that runs the generations."""

    def __init__(self, settings: ServeSettings, service: Service):
        self.settings, self.service = settings, service

    async def respond(self, body: CompletionRequest | ChatRequest, request: Request) -> Response:
        body.refuse_unsupported()
        if body.model and body.model != self.settings.served_model:
            raise APIError(
                "not_found",
                f"the model {body.model!r} does not exist here; this server serves "
                f"{self.settings.served_model!r}",
                param="model",
                code="model_not_found",
            )
        streams = await self.service.open(body)
        watcher = asyncio.create_task(self._watch_disconnect(request, streams))
        streaming = False
        try:
            firsts = [await stream.next() for stream in streams]
            chat = isinstance(body, ChatRequest)
            shapes = [stream.shape for stream in streams]
            writer = Writer(chat, self.settings.served_model, shapes)
            headers = streams[0].headers
            if body.stream and not any(isinstance(first, Failed) for first in firsts):
                streaming = True  # the stream owns the watcher from here
                events = self._stream(streams, firsts, writer, body.include_usage, watcher)
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            pairs = zip(streams, firsts, strict=True)
            results = [await self._result(stream, first) for stream, first in pairs]
            return JSONResponse(writer.response(results), headers=headers)
        finally:
            if not streaming:
                watcher.cancel()
                for stream in streams:
                    stream.cancel()  # a no-op once done; otherwise this handler was cancelled

    async def _result(self, stream: Stream, event: Event) -> Result:
        while isinstance(event, Delta):
            event = await stream.next()
        if isinstance(event, Failed):
            raise event.error
        if event.result.finish_reason == "shutdown":
            raise cut_short()  # a 503: the client's retry finds another replica
        return event.result

    async def _stream(self, streams, firsts, writer: Writer, include_usage, watcher):
        """Server-sent events as OpenAI sends them, each choice's chunks as they come, ending
        with `data: [DONE]`."""
        events: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, event: Event) -> None:
            while True:
                await events.put((index, event))
                if not isinstance(event, Delta):
                    return
                event = await streams[index].next()

        tasks = [asyncio.create_task(forward(i, first)) for i, first in enumerate(firsts)]
        try:
            while not writer.done:
                index, event = await events.get()
                if isinstance(event, Delta):
                    yield sse(writer.chunk(index, event.text, event.logprobs))
                elif isinstance(event, Done):
                    yield sse(writer.last_chunk(index, event.result))
                    if event.result.finish_reason == "shutdown":
                        yield sse(cut_short().body())  # the client's library raises on it
                        break
                else:
                    self.service.metrics.outcome(event.error.outcome)
                    yield sse(event.error.body())
                    break
            else:
                if include_usage:
                    yield sse(writer.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.cancel()  # a no-op once done; otherwise the client left mid-stream

    async def _watch_disconnect(self, request: Request, streams: list[Stream]) -> None:
        """Cancel the request's generations when the client goes away."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in streams:
            stream.cancel()


def cut_short() -> APIError:
    """The error a request ended by the server's shutdown gets, after what it had made."""
    return APIError(
        "unavailable",
        "the server shut down before this generation finished (finish_reason 'shutdown'); "
        "retry, another replica will serve it",
        code="shutting_down",
        headers={"Retry-After": "1"},
    )


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def create_app(
    settings: ServeSettings,
    runtime: SpeculativeRuntime | None = None,
    service: Service | None = None,
) -> FastAPI:
    """The app for one bundle. By default it runs the engines in this process (a `LocalService`):
    pass a loaded runtime to serve it at once (its engines then belong to the app's worker
    thread), or none and the app loads the bundle when it starts. The Ray Serve ingress passes
    a service that forwards to its engine replicas instead."""
    service = service or LocalService(settings, runtime)
    server = Server(settings, service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        service.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.service = service
    app.state.metrics = service.metrics
    errors.install(app)
    app.add_middleware(BodyLimit, limit=settings.body_bytes(), metrics=service.metrics)
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key, metrics=service.metrics)
    app.add_middleware(RequestIds)  # the outermost: every answer carries its id

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.respond(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await server.respond(body, request)

    _describe(app, settings, service)
    return app


def _describe(app: FastAPI, settings: ServeSettings, service: Service) -> None:
    """The routes that describe the server: health, the model, metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        status, detail = await service.health()
        return JSONResponse(
            {"status": status, **detail},
            status_code=200 if status == "ok" else errors.status_of("unavailable"),
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await service.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.served_model:
            raise APIError(
                "not_found", f"the model {model_id!r} does not exist", code="model_not_found"
            )
        return await service.model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        text = service.metrics.exposition()
        if text is None:
            raise APIError("not_found", service.metrics.instruments.where, code="metrics_elsewhere")
        return Response(text, media_type=Metrics.content_type)
