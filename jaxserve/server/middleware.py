"""Pure ASGI middleware: API key, X-Request-Id, and the in-flight count behind GET /load."""

from __future__ import annotations

import hmac
import uuid

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import APIError, error_response

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")  # vLLM's aliases: /v2/rerank is Cohere's v2 path
SCORE_PATHS = ("/v1/score", "/score")
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses",
                            "/v1/messages", "/v1/embeddings", *RERANK_PATHS, *SCORE_PATHS})


class APIKey:
    """Pure ASGI middleware: 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on
    every path but the public ones.

    CORS preflights (OPTIONS) pass: browsers never send credentials with them.
    """

    def __init__(self, app: ASGIApp, key: str, public_paths: tuple[str, ...]):
        self.app = app
        self.key = key.encode()
        self.public = set(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"] not in self.public
        ):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not auth and b"x-api-key" in headers:
                auth, scheme, token = headers[b"x-api-key"], b"bearer", headers[b"x-api-key"]
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                msg = (
                    "Missing API key: send 'Authorization: Bearer <key>'."
                    if not auth
                    else "Invalid API key."
                )
                err = APIError(401, msg, code="invalid_api_key")
                await error_response(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestId:
    """Pure ASGI middleware: answer with X-Request-Id, the client's (if sane) or a new one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id", b"")
        if not (0 < len(rid) <= 128 and rid.isascii() and rid.decode().isprintable()):
            rid = uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class InFlight:
    """Generate calls in flight, until their last byte (vLLM's server load)."""

    def __init__(self) -> None:
        self.count = 0


class LoadCounter:
    """Pure ASGI middleware keeping an InFlight count of the generate routes' calls."""

    def __init__(self, app: ASGIApp, in_flight: InFlight):
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1
