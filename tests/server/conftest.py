"""A real uvicorn server on 127.0.0.1 (in a thread of the test process) over a tiny random model."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

ENGINE = {
    "max_model_len": 256,
    "num_blocks": 256,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 64,
    "block_size": 16,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`precompile=False` for a server whose test sends a few requests with an engine config of its
    own: compiling every bucket of a config the suite meets once costs a minute on 2 cores; the
    shared ENGINE config's executables come from the persistent compilation cache."""

    def __init__(self, model_dir, engine_kw: dict | None = None, precompile: bool = True, **server_kw):
        from jaxserve.config import EngineConfig
        from jaxserve.engine import LLMEngine
        from jaxserve.server.app import KEEP_ALIVE_S, build_app
        from jaxserve.server.config import ServerConfig
        from jaxserve.server.http_protocol import HeaderTimeoutProtocol

        self.engine = LLMEngine(
            EngineConfig(model=str(model_dir), **{**ENGINE, **(engine_kw or {})})
        )
        if precompile:
            self.engine.precompile()
        self.port = free_port()
        self.cfg = ServerConfig(port=self.port, **server_kw)
        self.app = build_app(self.engine, self.cfg)
        self.model = self.app.state.serving.model_names[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                           timeout_keep_alive=KEEP_ALIVE_S, http=HeaderTimeoutProtocol)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
        )

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
        )

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def on_engine(self, fn):
        """Run fn(engine) on the engine thread (the only thread allowed to touch it)."""
        aengine = self.app.state.engine
        return asyncio.run_coroutine_threadsafe(aengine.call(fn), aengine.loop).result(60)

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine thread (between steps) so requests queue up deterministically."""
        self._gate = threading.Event()
        aengine = self.app.state.engine
        fut = asyncio.run_coroutine_threadsafe(
            aengine.call(lambda e: self._gate.wait(60)), aengine.loop
        )
        try:
            yield
        finally:
            self.resume()
            fut.result(60)

    def resume(self) -> None:
        self._gate.set()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until the engine has no requests; return its stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.on_engine(lambda e: {**e.get_stats(), "num_requests": e.num_requests})
            if (
                stats["num_requests"] == 0
                and stats["num_running"] == 0
                and stats["num_waiting"] == 0
            ):
                return stats
            assert time.monotonic() < deadline, f"engine still busy: {stats}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="session")
def server(tiny_llama):
    s = ServerThread(tiny_llama)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def http(server):
    with server.http() as c:
        yield c
