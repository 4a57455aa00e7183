"""AsyncEngine: the synchronous LLMEngine behind an asyncio interface.

One dedicated thread owns the LLMEngine (it is not thread-safe) and is the only code that touches
it. The event loop talks to it through a FIFO command queue (add, abort, call); the thread sends
results back with `loop.call_soon_threadsafe`, once per step, so all bookkeeping on the asyncio
side (routes, counters, metrics) happens on the loop thread without locks.

    handler --add/abort--> queue.SimpleQueue --> engine thread: commands, step(), commands, step() ...
    handler <--(tag, RequestOutput)-- RequestStream <--call_soon_threadsafe(_deliver)--'

A RequestStream gathers the engine requests of one API call (one per prompt) into one async
iterator. Aborting it (client gone, shutdown) aborts every unfinished engine request, which frees
their KV blocks on the engine thread before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.errors import UserError
from jaxserve.outputs import RequestOutput
from jaxserve.server.offload import settle
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger("jaxserve.server")

_END = object()


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine aborted this request over an error in its own data; it serves on."""


class RequestStream:
    """The outputs of one API call's engine requests, as (tag, RequestOutput) in arrival order."""

    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self.pending: set[str] = set()  # engine request ids not finished yet
        self.aborted = False

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[tuple[Any, RequestOutput]]:
        while self.pending and not self.aborted:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            rid, tag, out = item
            if out.finished:
                self.pending.discard(rid)
            yield tag, out

    def abort(self) -> None:
        """Abort every unfinished request of this call; iteration ends. Idempotent."""
        if self.aborted:
            return
        self.aborted = True
        for rid in list(self.pending):
            self._engine.abort(rid)
        self.pending.clear()
        self._put(_END)

    @property
    def finished(self) -> bool:
        return not self.pending


class AsyncEngine:
    def __init__(
        self,
        engine,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_abort: Callable[[str, int], None] | None = None,
        hang_timeout: float = 120.0,
        idle_tick: float = 0.25,
    ):
        self.engine = engine
        self.hang_timeout = hang_timeout
        self.idle_tick = idle_tick
        self._on_output = on_output
        self._on_abort = on_abort
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, tuple[RequestStream, Any, int]] = {}  # id -> (stream, tag, n)
        self._pending_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.stats: dict = engine.get_stats()
        self._heartbeat = time.monotonic()
        self._step_started: float | None = None
        self.on_idle: Callable[[], None] | None = None  # run by the engine thread when it has no requests

    # ---- lifecycle (loop thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self.abort_all()
        self._stop = True
        self._cmds.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- requests (loop thread) ------------------------------------------------------------------
    def stream(self) -> RequestStream:
        return RequestStream(self)

    async def add(
        self,
        stream: RequestStream,
        request_id: str,
        tag: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue one engine request whose outputs go to `stream`. Raises UserError if it can never run."""
        self.check_alive()
        fut = self._loop.create_future()
        self._routes[request_id] = (stream, tag, params.n)
        stream.pending.add(request_id)
        self._pending_adds += 1
        self._cmds.put(("add", fut, request_id, prompt_token_ids, params, priority, cache_salt))
        try:
            await fut
        except BaseException as e:
            self._routes.pop(request_id, None)
            stream.pending.discard(request_id)
            if not isinstance(e, UserError):  # e.g. cancelled while queued: the add may still happen
                self._cmds.put(("abort", request_id))
            raise

    def abort(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None and self._on_abort is not None:
            self._on_abort(request_id, route[2])
        self._cmds.put(("abort", request_id))

    def abort_all(self) -> None:
        for stream in {r[0] for r in self._routes.values()}:
            stream.abort()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread, between steps (introspection, tests)."""
        self.check_alive()
        fut = self._loop.create_future()
        self._cmds.put(("call", fut, fn))
        return await fut

    # ---- state (loop thread) ---------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def num_active(self) -> int:
        """Engine requests admitted and not finished (including those still being added)."""
        return len(self._routes)

    @property
    def num_queued(self) -> int:
        """Requests waiting for their first step: being added, or in the scheduler's waiting queue."""
        return self._pending_adds + self.stats.get("num_waiting", 0)

    def health(self) -> str | None:
        """None if the loop is alive and stepping; otherwise why not."""
        if self.error is not None:
            return f"The engine loop died: {type(self.error).__name__}: {self.error}"
        if self._thread is None or not self._thread.is_alive():
            return "The engine loop is not running."
        now = time.monotonic()
        started = self._step_started
        if started is not None and now - started > self.hang_timeout:
            return (f"The engine step has been running for {now - started:.0f} s "
                    f"(hang timeout {self.hang_timeout:.0f} s).")
        if started is None and now - self._heartbeat > self.hang_timeout:
            return "The engine loop has stopped responding."
        return None

    def check_alive(self) -> None:
        reason = self.health()
        if reason is not None:
            raise EngineDeadError(reason)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop:
                self._heartbeat = time.monotonic()
                busy = eng.has_unfinished_requests()
                if not busy and self.on_idle is not None:
                    self.on_idle()
                added, ran = self._commands(block=not busy)
                outputs: list[RequestOutput] = []
                if eng.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    outputs = eng.step()
                    self._step_started = None
                if outputs or ran or busy:
                    self._post(self._deliver, outputs, eng.get_stats(), added)
        except BaseException as e:
            log.exception("The engine loop died")
            self._step_started = None
            self._post(self._fail, e)

    def _commands(self, block: bool) -> tuple[int, int]:
        """Run queued commands (waiting up to idle_tick for one when idle): (adds, commands) run."""
        added = ran = 0
        try:
            cmd = self._cmds.get(timeout=self.idle_tick) if block else self._cmds.get_nowait()
        except queue.Empty:
            return 0, 0
        while True:
            kind = cmd[0]
            ran += 1
            if kind == "add":
                _, fut, rid, ids, params, priority, salt = cmd
                added += 1
                try:
                    self.engine.add_request(
                        rid, None, params, prompt_token_ids=ids, priority=priority, cache_salt=salt
                    )
                    self._post(settle, fut, None, None)
                except UserError as e:
                    self._post(settle, fut, None, e)
                except Exception as e:  # noqa: BLE001 - a bug: this request fails (a 500), others go on
                    log.exception("Adding request %s failed", rid)
                    self._post(settle, fut, None, e)
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
            elif kind == "call":
                _, fut, fn = cmd
                try:
                    self._post(settle, fut, fn(self.engine), None)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self._post(settle, fut, None, e)
            elif kind == "stop":
                self._stop = True
                return added, ran
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return added, ran

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- back on the loop thread -----------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], stats: dict, added: int) -> None:
        self._pending_adds -= added
        self.stats = stats
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._routes[out.request_id]
            if self._on_output is not None:
                self._on_output(out)
            stream, tag, _ = route
            if out.error is not None:  # the stream ends with this request's error (raised when read)
                stream._put(RequestFailedError(out.error))
                continue
            stream._put((out.request_id, tag, out))

    def _fail(self, error: BaseException) -> None:
        self.error = error
        dead = EngineDeadError(f"The engine loop died: {type(error).__name__}: {error}")
        for stream in {r[0] for r in self._routes.values()}:
            stream._put(dead)
        self._routes.clear()
