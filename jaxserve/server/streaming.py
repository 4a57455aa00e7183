"""Server-sent events and client-disconnect watching.

A disconnect is detected by reading the ASGI `receive` channel (after the body has been read, the
next message is `http.disconnect`), not by waiting for a CancelledError that the server may or may
not raise into a streaming response. On disconnect the request is aborted at once, which frees its
KV blocks; the stream then ends by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

log = logging.getLogger("jaxserve.server")

DONE = b"data: [DONE]\n\n"


# Characters that str.splitlines (and so httpx's aiter_lines) treats as line ends but JSON leaves
# raw: escaped, so a model's text can never split an event's data line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(v) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps_yielding(v) -> str:
    """json.dumps(v) (compact, as sse() and JSONResponse write it), built from many small calls:
    the thread running it gives the GIL back between them. One json.dumps of an 8k-token
    prompt's logprobs (11 MB) holds the GIL ~0.5 s, and /health on the event loop waits."""
    if isinstance(v, dict):
        return "{" + ",".join(_dumps(k) + ":" + dumps_yielding(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        each = _dumps if len(v) > 64 else dumps_yielding  # a long list's items are small rows
        return "[" + ",".join(each(x) for x in v) + "]"
    return _dumps(v)


def sse(payload: dict, yielding: bool = False) -> bytes:
    """One SSE data event; `yielding` for a big payload encoded on a worker thread."""
    text = (dumps_yielding(payload) if yielding else _dumps(payload)).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Await `work`; if the client goes away first, call on_disconnect (which must end `work`)."""
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    work = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            log.info("Client disconnected: request aborted")
            on_disconnect()
        return await work
    finally:
        watcher.cancel()


class EventStream:
    """An ASGI response streaming `events` as SSE; aborts the work when the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            await _wait_disconnect(receive)
            if not finished:
                gone.set()
                log.info("Client disconnected mid-stream: request aborted")
                self.on_disconnect()

        finished = False
        watcher = asyncio.ensure_future(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async for chunk in self.events:
                if gone.is_set():
                    break
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:  # the transport broke before the disconnect message arrived
                    gone.set()
                    self.on_disconnect()
                    break
            finished = True
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            finished = True
            watcher.cancel()
            await self.events.aclose()
            if gone.is_set():
                self.on_disconnect()  # idempotent


def sse_event(name: str, payload: dict) -> bytes:
    """A named SSE event (`event: NAME`), as the Responses and Messages APIs stream them."""
    return b"event: " + name.encode() + b"\n" + sse(payload)
