"""Fixtures for the benchmark-tool smoke tests: tiny engine settings and a real server in a thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest

# Small enough that precompiling every bucket of the tiny model takes a few seconds.
ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64, "num_blocks": 96}
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
               "--kv-cache-memory", "8MiB"]


@pytest.fixture(scope="package")  # torn down after tests/bench, not kept for the whole suite
def bench_server(tiny_model):
    """`jaxserve serve`'s app over the tiny llama, on a free 127.0.0.1 port in a daemon thread."""
    import uvicorn

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.server.app import KEEP_ALIVE_S, build_app
    from jaxserve.server.config import ServerConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), precompile=False, **ENGINE))
    engine.precompile()
    app = build_app(engine, ServerConfig(port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
