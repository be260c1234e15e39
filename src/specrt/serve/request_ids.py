"""Request ids: every request has one, its response carries it back, and every log line about it
names it, so an operator can follow one client's complaint through the logs.

The id is the client's `X-Request-Id` where it sent a sane one (a load balancer's or a
gateway's, so one id runs through every hop), else a new one. The middleware holds it in a
context variable for the request's task: uvicorn's access line and the app's own lines read it
there. The engine thread is no part of that task, so a `Job` takes the id along and the
worker's lines pass it themselves (`extra={"request_id": ...}`).
"""

from __future__ import annotations

import copy
import logging
import re
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
SANE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")  # nothing that could forge a log line


class RequestIds:
    """ASGI middleware: the request's id in REQUEST_ID and in the response's header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER, b"").decode("latin-1")
        request_id = given if SANE.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message["headers"] = [*headers, (HEADER, request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class NamesRequest(logging.Filter):
    """Gives each record `request`: " [ID]" for a line about a request, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request = f" [{request_id}]" if request_id else ""
        return True


def log_config(level: str) -> dict:
    """uvicorn's logging, with the request's id on every line about one, and specrt's own
    lines (the worker's, the service's) beside uvicorn's at the same level."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"request": {"()": NamesRequest}}
    config["formatters"]["default"]["fmt"] = "%(levelprefix)s%(request)s %(message)s"
    access = '%(levelprefix)s%(request)s %(client_addr)s - "%(request_line)s" %(status_code)s'
    config["formatters"]["access"]["fmt"] = access
    for handler in config["handlers"].values():
        handler["filters"] = ["request"]
    config["loggers"]["specrt"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config
