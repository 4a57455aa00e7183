"""Many clients at once, some hanging up: the rest get their full output, and nothing leaks."""

from __future__ import annotations

import asyncio
import re
import socket

import httpx

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
