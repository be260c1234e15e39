"""specrt inside your own FastAPI app: one runtime, one engine thread, your own routes.

    pip install 'specrt[serve]'
    SPECRT_BUNDLE=path/to/bundle uvicorn examples.embed_fastapi:app --port 8001
    curl -s localhost:8001/answer -H 'content-type: application/json' -d '{"question":"hi"}'
    curl -sN localhost:8001/answer/stream -H 'content-type: application/json' -d '{"question":"hi"}'

What is thread-safe: `SpeculativeRuntime.stream(...)` only tokenizes and validates, so any
thread may call it (it raises SpecrtError for a bad request before anything runs). Iterating a
generation drives the runtime's two engines, which hold one KV cache each: only one generation
may be iterated at a time per runtime. Here a one-thread executor owns the engines, so requests
wait their turn and the event loop never blocks on an engine call. For a queue limit, timeouts,
cancellation when clients leave, metrics and the OpenAI API, run `specrt serve` instead.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from specrt.errors import SpecrtError
from specrt.runtime import Generation, SpeculativeRuntime

runtime = SpeculativeRuntime.load(os.environ.get("SPECRT_BUNDLE", "bundle"))
engines = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrt-engines")
app = FastAPI()


class Question(BaseModel):
    question: str
    max_new_tokens: int = 128


def start(q: Question) -> Generation:
    try:
        return runtime.stream(
            [{"role": "user", "content": q.question}], max_new_tokens=q.max_new_tokens
        )
    except SpecrtError as err:  # empty prompt, prompt past the context, bad parameters
        raise HTTPException(400, str(err)) from err


def run_to_end(generation: Generation):
    for _ in generation:
        pass
    return generation.result


@app.post("/answer")
async def answer(q: Question) -> dict:
    result = await asyncio.get_running_loop().run_in_executor(engines, run_to_end, start(q))
    return {"text": result.text, "acceptance": result.stats.acceptance_rate}


@app.post("/answer/stream")
async def answer_stream(q: Question) -> StreamingResponse:
    generation, loop = start(q), asyncio.get_running_loop()
    deltas: asyncio.Queue[str | None] = asyncio.Queue()

    def produce() -> None:  # on the engine thread; each delta crosses to the event loop
        try:
            for delta in generation:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)
        finally:
            loop.call_soon_threadsafe(deltas.put_nowait, None)

    loop.run_in_executor(engines, produce)

    async def body():
        try:
            while (delta := await deltas.get()) is not None:
                yield delta
        finally:
            generation.cancel()  # the client left: stop after the round in flight

    return StreamingResponse(body(), media_type="text/plain")
