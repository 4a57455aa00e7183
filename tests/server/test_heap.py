"""The server's heap: frozen again once the background warm-up is done, by the engine thread when it
has no requests (server/heap.py), so a full collection never walks the warm-up's objects mid-burst."""

from __future__ import annotations

import gc
import threading
import weakref
from types import SimpleNamespace

from jaxserve.server.heap import FreezeAfterWarmUp


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_heap_is_frozen_once_the_warm_up_is_done():
    warm = SimpleNamespace(done=False)
    hook = FreezeAfterWarmUp(warm)
    gc.collect()
    base = gc.get_freeze_count()
    try:
        alive = [Node() for _ in range(1000)]
        hook()  # still compiling: nothing happens
        assert gc.get_freeze_count() == base
        garbage = weakref.ref(Node())  # young cyclic garbage: collected by the freeze, not frozen
        assert garbage() is not None
        warm.done = True
        hook()
        frozen = gc.get_freeze_count()
        assert frozen >= base + len(alive)
        assert garbage() is None
        hook()  # once only
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_the_engine_thread_runs_the_idle_hook_between_requests(server):
    aengine = server.app.state.engine
    idle = threading.Event()
    threads = []

    def hook() -> None:
        threads.append(threading.current_thread().name)
        idle.set()

    aengine.on_idle = hook
    try:
        server.wait_idle()
        assert idle.wait(10)
        assert set(threads) == {"jaxserve-engine"}
        idle.clear()
        out = server.client().completions.create(model=server.model, prompt="Hello", max_tokens=4)
        assert out.choices[0].text is not None
        assert idle.wait(10)  # idle again after the request
    finally:
        aengine.on_idle = None
