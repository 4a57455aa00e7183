"""/health (and SageMaker's /ping, GET or POST) follows the engine loop: 503 while a step hangs, 503 once
it died, and clients are told."""

from __future__ import annotations

import json
import threading

import pytest

from tests.server.conftest import ServerThread


@pytest.fixture(scope="module")
def faulty(tiny_llama):
    s = ServerThread(tiny_llama)  # the shared config: its executables are in the compilation cache
    yield s
    s.stop()


def test_health_during_hung_step_then_death(faulty):
    engine, aengine = faulty.engine, faulty.app.state.engine
    real_step = engine.step
    release, entered = threading.Event(), threading.Event()

    def hung_step():
        entered.set()
        release.wait(60)
        return real_step()

    with faulty.http() as h:
        assert h.get("/health").status_code == 200
        aengine.hang_timeout = 0.2
        engine.step = hung_step
        done = []
        t = threading.Thread(
            target=lambda: done.append(
                h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            )
        )
        t.start()
        assert entered.wait(30)
        while (r := h.get("/health")).status_code == 200:  # answers while the step is stuck
            t.join(0.05)
        assert r.status_code == 503 and "running for" in r.json()["error"]["message"]
        assert h.get("/ping").status_code == 503 and h.post("/ping").status_code == 503
        engine.step = real_step
        aengine.hang_timeout = 120
        release.set()
        t.join(30)
        assert done[0].status_code == 200
        assert h.get("/health").status_code == 200
        assert h.get("/ping").json() == {"status": "ok"} and h.post("/ping").status_code == 200

        def boom():
            raise RuntimeError("device lost")

        engine.step = boom
        with h.stream(
            "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "stream": True}
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "engine_unavailable" and "device lost" in err["message"]
        r = h.get("/health")
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert h.get("/ping").json() == r.json()
        r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert h.get("/v1/models").status_code == 200  # the rest of the API still answers
