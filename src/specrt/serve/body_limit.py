"""A request body over `--max-body-size` is answered 413 before anything parses it.

Without a limit, a 64 MB chat message was read, parsed and tokenized in full (8.4 million
tokens, two minutes of a core) before the context check refused it; any client could repeat
that for free. A plain ASGI middleware, so the check comes before the framework reads the body:

- a declared `Content-Length` over the limit is refused at once;
- a chunked body is read up to the limit and handed on from memory, or refused there.

The refused body is read to its end and dropped before the answer goes out: HTTP clients send
the whole body before they read a reply, and one answered early sees a reset connection instead
of the 413. Past `DRAIN` times the limit, reading stops and the connection closes.
"""

from __future__ import annotations

from specrt.serve.errors import APIError

DRAIN = 16  # a refused body is read and dropped up to this many times the limit


class BodyLimit:
    def __init__(self, app, limit: int, metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, headers, int(declared))
            return
        if declared or b"chunked" not in headers.get(b"transfer-encoding", b""):
            await self.app(scope, receive, send)  # the server holds it to its declared length
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send, headers, size, message)
                return
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope, receive, send, headers, size, last=None) -> None:
        error = APIError(
            "too_large",
            f"the request body has {'at least ' * (last is not None)}{size} bytes; this server "
            f"takes at most {self.limit} (--max-body-size)",
            code="body_too_large",
        )
        self.metrics.outcome(error.outcome)
        if b"100-continue" not in headers.get(b"expect", b"").lower():
            read = 0
            while (last or {}).get("more_body", True) and read <= DRAIN * self.limit:
                last = await receive()
                if last["type"] != "http.request":
                    return  # the client left
                read += len(last.get("body", b""))
            if last.get("more_body"):
                error.headers = {"Connection": "close"}
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive):
    """The body read ahead, as the app's `receive` delivers it; then the server's own
    messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
