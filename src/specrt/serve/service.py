"""The engines' side of the server: what the routes ask of whoever runs the generations.

The app (`app.py`) knows HTTP and nothing of engines; it talks to a `Service`: is it healthy,
what model is this, and, per request, `open` a `Stream` of events (`Delta`, then `Done` or
`Failed`). `LocalService` runs the engines in this process, behind the worker thread: that is
`specrt serve`. The Ray Serve application (`specrt.serve.ray`) puts a `LocalService` in each
engine replica and gives the ingress a service that forwards to them, so one app, with the
same routes, errors, auth and SSE, is hosted both ways.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Protocol

from starlette.concurrency import run_in_threadpool

from specrt.errors import SpecrtError
from specrt.runtime import Sequence, SpeculativeRuntime
from specrt.runtime.budget import FITTING, KVBudget
from specrt.runtime.drafters import DRAFTERS
from specrt.serve.errors import APIError
from specrt.serve.events import Event
from specrt.serve.metrics import Metrics
from specrt.serve.protocol import ChatRequest, CompletionRequest
from specrt.serve.reasoning import (
    JSON_KINDS,
    after_thought,
    closes_thought,
    opens_thought,
    parses,
)
from specrt.serve.render import Shape
from specrt.serve.settings import ServeSettings
from specrt.serve.tool_formats import ToolFormat, choose
from specrt.serve.worker import Job, Worker, shutting_down

log = logging.getLogger("specrt.serve")

Body = CompletionRequest | ChatRequest


class Stream(Protocol):
    """One request's events. `next` never raises: failures arrive as a `Failed` event.
    `cancel` may be called at any time, also after the last event (then it does nothing)."""

    headers: dict[str, str]  # added to the response (which replica served it, under Ray)
    shape: Shape  # how its text is parsed (a thought, tool calls)

    async def next(self) -> Event: ...
    def cancel(self) -> None: ...


class Service(Protocol):
    metrics: Metrics

    def start(self) -> None: ...
    def stop(self) -> None: ...
    async def health(self) -> tuple[str, dict]: ...
    async def model_card(self) -> dict: ...
    async def open(self, body: Body) -> list[Stream]:
        """Queue a request, a stream per choice (raises APIError when it cannot be: not ready,
        bad values, full; then none of its choices stays queued)."""
        ...


class LocalService:
    """The engines in this process: the runtime once loaded, and the worker that runs it."""

    def __init__(
        self,
        settings: ServeSettings,
        runtime: SpeculativeRuntime | None = None,
        metrics: Metrics | None = None,
    ):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.runtime = runtime
        self.worker: Worker | None = None
        self.tool_format: ToolFormat | None = None  # tool calls' format, once loaded
        self.load_error: str | None = None
        self.draining = False  # shutting down: no more requests (see server.py)

    def start(self) -> None:
        """Load the engines (and calibrate) in the background; /health says when it is done."""
        if self.runtime is not None:
            self.worker = self._worker(self.runtime)
            return
        threading.Thread(target=self.load, name="specrt-load", daemon=True).start()

    def load(self) -> None:
        """Load the bundle's engines and start the worker; a failure is kept in `load_error`
        (reported by /health and every route, not a dead thread)."""
        s = self.settings
        try:
            slots = s.max_batch if s.backend.startswith("onnxruntime") else 1
            runtime = SpeculativeRuntime.load(
                s.bundle,
                backend=s.backend,
                calibrate=s.calibrate,
                threads=s.threads,
                slots=slots,
                prompt_cache=s.prompt_cache,
                prefix_store=s.prefix_bytes(),
                chat_template=s.template(),
                prefill_chunk=s.prefill_chunk or None,
                draft_window=s.draft_window or None,
            )
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {err}"
            return
        self.worker = self._worker(runtime)
        self.runtime = runtime

    def _worker(self, runtime: SpeculativeRuntime) -> Worker:
        self.tool_format = choose(self.settings.tool_parser, runtime.tokenizer.chat_template)
        if self.tool_format is not None:
            runtime.tokenizer.keep(self.tool_format.markers)
        batch, spec = min(self.settings.max_batch, runtime.slots), self.settings.kv_budget
        engines = [runtime.target, runtime.draft]
        store = runtime.prompt_cache.store_bytes if runtime.prompt_cache else 0
        if spec is not None:
            budget = KVBudget.parse(spec, engines)
        elif budget := KVBudget.fitting(engines, batch, store):
            log.info(
                "KV budget: %d positions, what %.0f%% of the memory available holds "
                "(--kv-budget sets it)",
                budget.positions,
                100 * FITTING,
            )
        return Worker(runtime, batch, self.settings.max_queue, self.metrics, budget)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def drain(self) -> None:
        """Shutting down: refuse new requests (503), let those admitted run."""
        self.draining = True
        if self.worker is not None:
            self.worker.drain()

    def end(self) -> None:
        """Stop what still runs (the drain's time is up): see Worker.end."""
        if self.worker is not None:
            self.worker.end()

    @property
    def idle(self) -> bool:
        return self.worker is None or self.worker.idle

    def status(self) -> tuple[str, dict]:
        """ok, loading, draining or error, with a detail for /health."""
        if self.draining:
            return "draining", {"detail": "shutting down: finishing the requests in flight"}
        if self.load_error:
            return "error", {"detail": f"the bundle could not be loaded: {self.load_error}"}
        if self.runtime is None or self.worker is None:
            return "loading", {"detail": "loading and calibrating the engines"}
        if self.worker.failure:
            return "error", {"detail": f"the engines failed: {self.worker.failure}"}
        return "ok", {"model": self.settings.served_model, "waiting": self.worker.depth}

    async def health(self) -> tuple[str, dict]:
        return self.status()

    def ready(self) -> tuple[SpeculativeRuntime, Worker]:
        status, detail = self.status()
        if status == "draining":
            raise APIError.from_specrt(shutting_down())
        if status != "ok":
            raise APIError(
                "unavailable", f"the server is not ready: {detail['detail']}", code=status
            )
        return self.runtime, self.worker

    async def model_card(self) -> dict:
        card = {"id": self.settings.served_model, "object": "model", "owned_by": "specrt"}
        if self.runtime is not None:
            bundle = self.runtime.bundle
            card |= {
                "max_model_len": bundle.max_context,
                "k_max": bundle.max_draft,
                "precision": bundle.precision_label,
                "drafters": list(DRAFTERS) if bundle.has_draft else ["ngram"],
            }
            if self.worker is not None and self.worker.scheduler.budget is not None:
                card["kv_budget"] = self.worker.scheduler.budget.positions
            if self.runtime.prompt_cache is not None:
                card["prefix_cache_bytes"] = self.runtime.prompt_cache.store_bytes
        return card

    def sequences(self, body: Body) -> tuple[list[Sequence], Shape]:
        """The runtime's sequences for a request, one per choice, and how their text is parsed
        (tokenizes: call it off the event loop)."""
        runtime, limit = self.runtime, body.token_limit
        prompt_field = "messages" if isinstance(body, ChatRequest) else "prompt"
        options, asked = body.options(self.settings.controller, self.settings.drafter)
        try:
            tools, form = body.tool_plan(options.structure), self.tool_format
            if tools is not None:
                tools.check_format(form)
                structure = tools.structure(runtime.grammars, form)
                if structure is not None:
                    options, asked = replace(options, structure=structure), "tool_choice"
            rendered = tools.rendered if tools else None
            ids = runtime.encode(body.prompt_input(), rendered, body.template_kwargs)
            room = runtime.bundle.max_context - len(ids)
            if limit is not None and limit > room:
                raise APIError(
                    "invalid",
                    f"the prompt has {len(ids)} tokens and max_tokens asks for {limit} more; the "
                    f"model's context is {runtime.bundle.max_context} tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            maximum = min(limit or body.default_max_tokens or room, room)
            options = replace(options, max_new_tokens=maximum, timeout=self.settings.timeout)
            parsed = form if tools is not None and tools.parses else None
            thinking, options = self._thinking(body, options, ids, asked == "tool_choice")
            shape = Shape(thinking, parsed)
            return runtime.sequences(ids, options, body.n), shape
        except SpecrtError as err:
            renames = {"structure": asked}
            raise APIError.from_specrt(err, prompt_field, renames) from err

    def _thinking(self, body: Body, options, ids: list[int], tool_call: bool) -> tuple:
        """Whether a chat request's output is parsed for a thought (--reasoning-parser) and
        whether its prompt left one open (None: not parsed), and its options: a JSON
        structure then starts after the thought (reasoning.after_thought). Other structures
        (a required tool call, a regex, a grammar), and any after a prompt that closed the
        thought itself (thinking switched off), start at the first token: the output is the
        answer, not parsed."""
        tokenizer, structure = self.runtime.tokenizer, options.structure
        if not isinstance(body, ChatRequest):
            return None, options
        if not parses(self.settings.reasoning_parser, tokenizer.chat_template):
            return None, options
        tail = "".join(map(tokenizer.token_text, ids[-32:]))
        inside = opens_thought(tail)
        if structure is None:
            return inside, options
        if tool_call or structure.kind not in JSON_KINDS or closes_thought(tail):
            return None, options
        wrapped = after_thought(structure, inside, self.runtime.grammars.literal)
        return inside, replace(options, structure=wrapped)

    async def open(self, body: Body) -> list[Job]:
        """A job per choice, queued together: if one cannot be (the queue is full), none stays."""
        _, worker = self.ready()
        sequences, shape = await run_in_threadpool(self.sequences, body)
        jobs = [Job(sequence, shape) for sequence in sequences]
        try:
            for job in jobs:
                worker.submit(job)
        except SpecrtError as err:  # full, or shutting down
            for job in jobs:
                job.cancel()
            raise APIError.from_specrt(err) from err
        return jobs
