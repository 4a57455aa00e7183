"""uvicorn's h11 protocol, but a client that stops mid-headers is disconnected.

uvicorn arms its keep-alive timer only after a response: a connection that sends part of a
request line or headers and then nothing (a stalled or hostile client, slowloris) held its socket
forever. Here a connection whose request head is not complete `header_timeout` seconds after it
opened (or after its next request began) is closed. Request bodies are bounded elsewhere
(--max-body-bytes, the route's own reads).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 30.0


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S  # a class attribute, so a test can shorten it

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self._head_timer is None:  # a head has begun (or not yet): it gets one deadline
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle between requests: uvicorn's keep-alive timer takes over

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and self.cycle is None and not self.transport.is_closing():
            self.transport.close()
