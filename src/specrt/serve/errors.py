"""Errors as OpenAI's API words them: one exception type, one handler, registered once.

Bodies are `{"error": {"message", "type", "param", "code"}}`, so the official clients raise
their own typed errors (BadRequestError, AuthenticationError, RateLimitError, ...).
"""

from __future__ import annotations

import functools

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specrt.errors import SpecrtError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}

# The Python API's argument names, as the HTTP API spells them.
API_PARAMS = {
    "max_new_tokens": "max_tokens",
    "controller": "speculation",
    "drafter": "speculation.drafter",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def __reduce__(self):
        """Exceptions pickle their args alone; under Ray an error crosses from an engine
        replica to the ingress, status, code and headers included."""
        options = {"param": self.param, "code": self.code, "headers": self.headers}
        return functools.partial(APIError, **options), (self.status, self.message)

    @classmethod
    def from_specrt(
        cls, err: SpecrtError, prompt_field: str = "prompt", renames: dict | None = None
    ) -> APIError:
        """A runtime refusal of the request's values: 400, naming the field at fault (renames:
        the request's own name for a runtime argument, where it depends on the request)."""
        param = (renames or {}).get(err.param) or API_PARAMS.get(err.param, err.param)
        if param == "prompt":
            param = prompt_field
        return cls(400, str(err), param=param, code=err.code)

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _field(loc: tuple) -> str | None:
    """`body.messages.0.content` -> `messages.0.content` (the request's own field path)."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


OUTCOMES = {401: "unauthorized", 429: "rejected", 500: "error", 503: "unavailable", 504: "timeout"}


def outcome(status: int) -> str:
    """The metrics' name for a request that ended with this error status."""
    return OUTCOMES.get(status, "invalid")


def _count(request: Request, status: int) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.outcome(outcome(status))


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    _count(request, err.status)
    return err.response()


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    _count(request, 400)
    problems = err.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    where = _field(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return APIError(400, message, code="invalid_json").response()
    message = f"{where}: {first['msg']}" if where else first["msg"]
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' * (len(problems) > 2)})"
    return APIError(400, message, param=where, code="invalid_value").response()


async def _http(request: Request, err: HTTPException) -> JSONResponse:
    _count(request, err.status_code)
    return APIError(err.status_code, str(err.detail)).response()


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
