"""API key, body size limit, queue limit (429), draining (503), and /metrics counters."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.server.conftest import ServerThread
from tests.server.test_concurrency import metric

KEY = "sekret-key"


@pytest.fixture(scope="module")
def strict(tiny_llama):
    """One sequence at a time, at most 2 queued, a key on everything but /health, 32 KiB bodies."""
    s = ServerThread(
        tiny_llama,
        {"max_num_seqs": 1},
        precompile=False,
        api_key=KEY,
        public_paths=("/health",),
        max_body_bytes=32 * 1024,
        max_queued_requests=2,
    )
    yield s
    s.stop()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


GOOD = {"prompt": "Hello", "max_tokens": 2}


def test_api_key(strict):
    with strict.http() as h:
        for headers in ({}, auth("wrong"), auth(KEY + "x"), {"Authorization": KEY}):
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("GET", "/metrics"),
            ):
                r = h.request(
                    method, path, headers=headers, json=GOOD if method == "POST" else None
                )
                assert r.status_code == 401, (headers, path)
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert h.get("/health").status_code == 200  # public
        assert h.get("/metrics", headers=auth()).status_code == 200
        assert h.post("/v1/completions", headers=auth(), json=GOOD).status_code == 200
    import openai

    with pytest.raises(openai.AuthenticationError):
        strict.client(api_key="wrong").models.list()
    assert (
        strict.client(api_key=KEY)
        .completions.create(model=strict.model, prompt="Hi", max_tokens=2)
        .choices
    )


def test_no_key_needed_without_api_key(server, http):
    assert http.get("/v1/models").status_code == 200  # the shared server runs without a key


def test_body_size_limit(strict):
    with strict.http(headers=auth()) as h:
        big = {"prompt": "x" * (40 * 1024), "max_tokens": 2}
        r = h.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert "xxxxxxxxxx" not in r.text
        assert h.post("/v1/completions", json=GOOD).status_code == 200

        def chunked():  # no Content-Length: counted while read
            for _ in range(40):
                yield b" " * 1024
            yield b'{"prompt": "Hi"}'

        r = h.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert h.post("/v1/completions", json=GOOD).status_code == 200


def test_queue_overflow_429(strict):
    """While the engine thread is held, requests pile up in the queue: 2 may wait, the rest get 429 at once."""
    with strict.paused():

        async def burst():
            async with httpx.AsyncClient(base_url=strict.url, headers=auth(), timeout=60) as ac:
                tasks = [
                    asyncio.ensure_future(ac.post("/v1/completions", json=GOOD)) for _ in range(6)
                ]
                _done, _ = await asyncio.wait(
                    tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED
                )
                while (
                    sum(t.done() for t in tasks) < 4
                ):  # the refused ones come back while the engine is held
                    await asyncio.sleep(0.01)
                early = sorted(t.result().status_code for t in tasks if t.done())
                strict.resume()
                return early, sorted(r.status_code for r in await asyncio.gather(*tasks))

        early, codes = asyncio.run(burst())
    assert early == [429] * 4
    assert codes == [200, 200, 429, 429, 429, 429]
    with strict.http(headers=auth()) as h:
        assert h.post("/v1/completions", json=GOOD).status_code == 200
    assert strict.wait_idle()["blocks_used"] == 0


def test_429_body(strict):
    strict.app.state.serving.cfg.max_queued_requests, saved = (
        0,
        strict.app.state.serving.cfg.max_queued_requests,
    )
    try:
        with strict.http(headers=auth()) as h:
            r = h.post("/v1/completions", json=GOOD)
            assert r.status_code == 429
            assert (
                r.json()["error"]["type"] == "rate_limit_error"
                and r.json()["error"]["code"] == "queue_full"
            )
    finally:
        strict.app.state.serving.cfg.max_queued_requests = saved


def test_metrics_counters_move(server, http, client):
    before = http.get("/metrics").text
    prompt = "Once upon a time there was a small model that learned to count: one, two, three"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    assert n_prompt > 16  # at least one full block, so the repeat hits the prefix cache
    for _ in range(2):
        client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    after = http.get("/metrics").text

    def moved(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    names = ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
             "request_queue_time_seconds_count", "inter_token_latency_seconds_count"]
    print({n: moved(n) for n in names})
    assert moved("prompt_tokens_total") == 2 * n_prompt
    assert moved("generation_tokens_total") == 10
    assert moved("request_success_total", 'finished_reason="length"') == 2
    assert moved("prefix_cache_queries_total") >= 2 and moved("prefix_cache_hits_total") >= 1
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert moved(h + "_count") == 2, h
    assert moved("inter_token_latency_seconds_count") == 8
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
    ):
        assert f"jaxserve:{name}" in after


def test_drain_refuses_new_work_and_aborts_at_timeout(strict):
    """What SIGTERM does (end to end in test_shutdown): 503 for new work, abort what is left at the timeout."""
    from jaxserve.server.app import drain

    aengine = strict.app.state.engine
    with strict.http(headers=auth()) as h, strict.paused():
        held = []
        t = threading.Thread(
            target=lambda: held.append(h.post("/v1/completions", json={**GOOD, "stream": True}))
        )
        t.start()
        while aengine.num_active == 0:  # admitted; its add waits for the held engine thread
            t.join(0.01)
        fut = asyncio.run_coroutine_threadsafe(drain(strict.app, 0.3), aengine.loop)
        r = h.post("/v1/completions", json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert h.get("/health").status_code == 503
        fut.result(30)  # timed out: the held request was aborted
        strict.resume()
        t.join(30)
        assert held[0].status_code == 503 and held[0].json()["error"]["code"] == "shutting_down"
    assert strict.wait_idle()["blocks_used"] == 0
