"""Many clients at once, some hanging up: the rest get their full output, and nothing leaks."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port

NUM_CLIENTS = 32
NUM_DISCONNECT = NUM_CLIENTS // 4
MAX_TOKENS = 24


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for m in re.finditer(rf"^jaxserve:{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        if labels in m[1]:
            total += float(m[2])
    return total


def assert_engine_clean(server) -> dict:
    stats = server.wait_idle()
    assert stats["blocks_used"] == 0, stats
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["num_blocks"] - 1
    server.on_engine(lambda e: e.scheduler.kv.check_invariants())
    return stats


def test_32_streams_quarter_disconnect(server, client, http):
    prompts = [f"Request {i}: the capital of France is" for i in range(NUM_CLIENTS)]
    kw = {
        "model": server.model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    reference = {
        i: client.completions.create(prompt=prompts[i], **kw).choices[0].text
        for i in range(NUM_DISCONNECT, NUM_CLIENTS)
    }
    aborts_before = metric(
        http.get("/metrics").text, "request_success_total", 'finished_reason="abort"'
    )
    health = []

    async def full(ac, i):
        text, finishes = "", []
        stream = await ac.completions.create(prompt=prompts[i], stream=True, **kw)
        async for ch in stream:
            text += ch.choices[0].text
            finishes += [ch.choices[0].finish_reason] if ch.choices[0].finish_reason else []
        return text, finishes

    async def hang_up(ac, i):
        stream = await ac.completions.create(
            prompt=prompts[i], stream=True, **{**kw, "max_tokens": 240}
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()  # closes the connection mid-stream
        return n

    async def probe_health(ah):
        for _ in range(5):
            health.append((await ah.get("/health")).status_code)
            await asyncio.sleep(0.05)

    async def main():
        ac = server.async_client(
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        )
        async with httpx.AsyncClient(base_url=server.url) as ah:
            return await asyncio.gather(
                *[hang_up(ac, i) for i in range(NUM_DISCONNECT)],
                *[full(ac, i) for i in range(NUM_DISCONNECT, NUM_CLIENTS)],
                probe_health(ah),
            )

    results = asyncio.run(main())
    assert results[:NUM_DISCONNECT] == [3] * NUM_DISCONNECT
    for i, (text, finishes) in zip(range(NUM_DISCONNECT, NUM_CLIENTS), results[NUM_DISCONNECT:-1]):
        assert finishes == ["length"], i
        assert text == reference[i], i
    assert health == [200] * 5

    assert_engine_clean(server)
    m = http.get("/metrics").text
    assert metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0
    assert metric(m, "kv_cache_usage_perc") == 0
    assert (
        metric(m, "request_success_total", 'finished_reason="abort"') - aborts_before
        == NUM_DISCONNECT
    )


def test_non_streaming_disconnect_aborts(server, http):
    aborts_before = metric(
        http.get("/metrics").text, "request_success_total", 'finished_reason="abort"'
    )
    body = (
        b'{"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": true, "n": 2, '
        b'"model": "%s"}' % server.model.encode()
    )
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    # Wait until the engine runs it, then hang up.
    for _ in range(600):
        if server.on_engine(lambda e: e.num_requests) == 1:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert server.on_engine(lambda e: e.num_requests) == 1
    sock.close()
    assert_engine_clean(server)
    after = metric(http.get("/metrics").text, "request_success_total", 'finished_reason="abort"')
    assert after - aborts_before == 2  # both choices
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_256_concurrent_streams(tiny_llama, tmp_path):
    """Issue 18's load check: 256 streaming clients (max_tokens 32) against `jaxserve serve` in its
    own process: every stream well formed, /health answering throughout (probed from its own
    thread), no KV block in use afterwards. Prints the /health latencies."""
    from tests.server.test_shutdown import engine_gauge, start_serve

    num, latencies, stop = 256, [], threading.Event()
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def one(ah: httpx.AsyncClient, i: int) -> list[str]:
        body = {"prompt": f"Client {i} says", "max_tokens": 32, "ignore_eos": True, "stream": True}
        async with ah.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            return [x[6:] async for x in r.aiter_lines() if x.startswith("data: ")]

    def probe(codes: list[int]) -> None:
        with httpx.Client(base_url=url, timeout=30) as h:
            while not stop.is_set():
                t0 = time.perf_counter()
                codes.append(h.get("/health").status_code)
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    async def main() -> list[list[str]]:
        limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as ah:
            return await asyncio.gather(*[one(ah, i) for i in range(num)])

    with open(tmp_path / "serve.log", "w+") as log:
        proc = start_serve(tiny_llama, port, url, log, "--max-num-seqs", "64")
        try:
            codes: list[int] = []
            prober = threading.Thread(target=probe, args=(codes,))
            prober.start()
            try:
                streams = asyncio.run(main())
            finally:
                stop.set()
                prober.join(30)
            assert engine_gauge(url, "running") == engine_gauge(url, "waiting") == 0
            kv = metric(httpx.get(url + "/metrics").text, "kv_cache_usage_perc")
        finally:
            proc.terminate()
            proc.wait(60)
    for lines in streams:
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(codes) >= 10 and set(codes) == {200}
    assert kv == 0  # every block free
    lat = sorted(latencies)
    print(
        f"\n/health during 256 streams: {len(lat)} probes, median {lat[len(lat) // 2] * 1e3:.1f} "
        f"ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
    )
