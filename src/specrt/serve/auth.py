"""Bearer-token authentication in front of every route but the open ones (health checks).

A plain ASGI middleware, so the key is checked before anything reads the body: a request
without the key gets 401 whatever else is wrong with it.
"""

from __future__ import annotations

import hmac

from specrt.serve.errors import APIError


class BearerAuth:
    def __init__(self, app, key: str, metrics, open_paths=frozenset({"/health"})):
        self.app, self.key, self.metrics, self.open_paths = app, key.encode(), metrics, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = (
                    "a missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                    "with the server's --api-key"
                )
                error = APIError("unauthorized", message, code="invalid_api_key")
                self.metrics.outcome(error.outcome)
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
