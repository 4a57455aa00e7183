"""CPU-bound request work (chat templates, tokenizing) off the event loop, with a time bound.

A chat template is a program: a request-supplied one (or a huge message list) can loop for minutes.
Run on the event loop it would stall every request, `/health` included. `run_bounded` runs the
work on a fresh daemon thread and awaits it for at most `timeout` seconds; on timeout (or when the
waiting request is cancelled) it raises an exception inside that thread, which stops a Jinja
render at its next Python bytecode, and answers a 400. A fresh thread per call means a late
interrupt can never land in unrelated work. The event loop meanwhile gets the GIL at least every
switch interval (5 ms), so it keeps answering.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import Any

from jaxserve.errors import UserError


class _Interrupted(BaseException):
    """Raised inside a worker thread whose caller stopped waiting."""


def _interrupt(thread: threading.Thread) -> None:
    if thread.is_alive() and thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupted)
        )


def settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Complete a future from the loop thread (call it with call_soon_threadsafe), unless it is
    already done (cancelled meanwhile)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


async def run_bounded(fn: Callable[[], Any], timeout: float, what: str, param: str | None) -> Any:
    """fn() on its own thread; a UserError naming `param` if it takes longer than `timeout` s."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work() -> None:
        try:
            result = fn()
        except _Interrupted:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            loop.call_soon_threadsafe(settle, fut, None, e)
            return
        loop.call_soon_threadsafe(settle, fut, result, None)

    thread = threading.Thread(target=work, name="jaxserve-offload", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        _interrupt(thread)
        raise UserError(
            f"{what} took longer than the server's limit of {timeout:g} s: send a shorter or "
            "simpler request.",
            param=param,
            code="timeout",
        ) from None
    except asyncio.CancelledError:
        _interrupt(thread)
        raise
