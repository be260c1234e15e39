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

# The one table: an error's kind -> its HTTP status, OpenAI's error type, the metrics' outcome.
# The runtime raises kinds (`specrt.errors`), the serve modules name them; only here are they
# statuses.
KINDS = {
    "invalid": (400, "invalid_request_error", "invalid"),
    "unauthorized": (401, "authentication_error", "unauthorized"),
    "not_found": (404, "not_found_error", "invalid"),
    "too_large": (413, "invalid_request_error", "invalid"),
    "busy": (429, "rate_limit_error", "rejected"),
    "engine": (500, "server_error", "error"),
    "unavailable": (503, "server_error", "unavailable"),
    "timeout": (504, "timeout_error", "timeout"),
}
STATUSES = {status: kind for kind, (status, _, _) in KINDS.items()}


def status_of(kind: str) -> int:
    """The HTTP status of an error kind (for answers that are not an error body: /health)."""
    return KINDS[kind][0]


# The Python API's argument names, as the HTTP API spells them.
API_PARAMS = {
    "max_new_tokens": "max_tokens",
    "controller": "speculation",
    "drafter": "speculation.drafter",
}


class APIError(Exception):
    """An error as the HTTP API answers it. kind is one of KINDS; status is the kind's, except
    for a framework error passed through with its own (405 and the like)."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ):
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code
        self.headers = headers
        self.status = status or KINDS[kind][0]

    def __reduce__(self):
        """Exceptions pickle their args alone; under Ray an error crosses from an engine
        replica to the ingress, status, code and headers included."""
        options = {"param": self.param, "code": self.code, "headers": self.headers}
        return functools.partial(APIError, status=self.status, **options), (
            self.kind,
            self.message,
        )

    @classmethod
    def from_specrt(
        cls, err: SpecrtError, prompt_field: str = "prompt", renames: dict | None = None
    ) -> APIError:
        """A runtime error as the API answers it, by its kind; a refusal of the request's
        values names the field at fault (renames: the request's own name for a runtime
        argument, where it depends on the request)."""
        param = (renames or {}).get(err.param) or API_PARAMS.get(err.param, err.param)
        if param == "prompt":
            param = prompt_field
        retry = getattr(err, "retry_after", None)
        headers = {"Retry-After": str(retry)} if retry is not None else None
        return cls(err.kind, str(err), param=param, code=err.code, headers=headers)

    @property
    def outcome(self) -> str:
        """The metrics' name for a request that ended with this error."""
        return KINDS[self.kind][2]

    def body(self) -> dict:
        kind = KINDS[self.kind][1]
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _field(loc: tuple) -> str | None:
    """`body.messages.0.content` -> `messages.0.content` (the request's own field path)."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _counted(request: Request, err: APIError) -> JSONResponse:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.outcome(err.outcome)
    return err.response()


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return _counted(request, err)


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    problems = err.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    where = _field(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return _counted(request, APIError("invalid", message, code="invalid_json"))
    message = f"{where}: {first['msg']}" if where else first["msg"]
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' * (len(problems) > 2)})"
    return _counted(request, APIError("invalid", message, param=where, code="invalid_value"))


async def _http(request: Request, err: HTTPException) -> JSONResponse:
    status = err.status_code
    error = APIError(STATUSES.get(status, "invalid"), str(err.detail), status=status)
    return _counted(request, error)


def install(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
