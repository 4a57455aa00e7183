"""`jaxserve serve` as a user runs it: a subprocess, SIGTERM drains in-flight work, then exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import free_port
from tests.server.test_concurrency import metric


# These servers see a few requests: their buckets compile on first use (a full precompile of each
# config costs a minute on 2 cores, and shutdown is what is tested here).
LAZY = ("--no-precompile",)


def test_serve_cli_sigterm_drains(tiny_llama, tmp_path):
    """In-flight streams run to the end, new requests get 503, the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w+") as log:
        _run(tiny_llama, port, url, log)


def start_serve(tiny_llama, port: int, url: str, log, *flags: str) -> subprocess.Popen:
    """`jaxserve serve` in a subprocess, returned once /health answers 200."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            "4MiB",
            "--served-model-name",
            "tiny",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 240
    while True:
        try:
            assert proc.poll() is None, _tail(log)
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        except BaseException:
            proc.kill()
            raise
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(_tail(log))
        time.sleep(0.2)


def _run(tiny_llama, port: int, url: str, log) -> None:
    proc = start_serve(
        tiny_llama, port, url, log, "--max-num-seqs", "8", "--shutdown-timeout", "60", *LAZY
    )
    try:
        assert "Ready" in _tail(log) and url in _tail(log) and "KV cache" in _tail(log)

        results = []
        first_chunks = [threading.Event() for _ in range(2)]  # SIGTERM once both are in flight

        def stream(i):
            body = {
                "model": "tiny",
                "prompt": f"Story {i}",
                "max_tokens": 480,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                chunks = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        first_chunks[i].set()
            results.append((r.status_code, chunks))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first_chunks)
        refused = False
        proc.send_signal(signal.SIGTERM)
        try:
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": "late", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            refused = True
        except httpx.ConnectError:  # only possible if the in-flight work had already finished
            assert len(results) == 2, "refused connections while requests were in flight"
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0, _tail(log)
        assert len(results) == 2
        for status, chunks in results:  # in-flight requests ran to the end
            assert status == 200 and chunks and chunks[-1] == "[DONE]", (status, chunks[-3:])
            finishes = [
                c["choices"][0]["finish_reason"]
                for c in map(json.loads, chunks[:-1])
                if c["choices"][0]["finish_reason"]
            ]
            assert finishes == ["length"]
        assert refused or len(results) == 2
        print("503 while draining:", refused)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-4000:]


def stream_lines(url: str, body: dict, out: list, started: threading.Event) -> None:
    """POST a streamed completion; append its data lines ([DONE] included) to out."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        out.append(f"error: {type(e).__name__}")
        started.set()


def finish_reasons(lines: list[str]) -> list[str]:
    return [
        c["choices"][0]["finish_reason"]
        for c in map(json.loads, (x for x in lines if x.startswith("{")))
        if c.get("choices") and c["choices"][0]["finish_reason"]
    ]


def test_shutdown_timeout_aborts_with_abort_chunks_and_503(tiny_llama, tmp_path):
    """Work the shutdown timeout cuts: streams end 'abort' then [DONE]; the rest get a 503 body."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    long = {"model": "tiny", "prompt": "Story", "max_tokens": 480, "ignore_eos": True}
    with open(tmp_path / "serve.log", "w+") as log:
        proc = start_serve(
            tiny_llama, port, url, log, "--max-num-seqs", "1", "--shutdown-timeout", "0", *LAZY
        )
        try:
            lines, started, whole = [], threading.Event(), []
            runner = threading.Thread(  # runs first; the stream waits behind it
                target=lambda: whole.append(
                    httpx.post(url + "/v1/completions", json=long, timeout=120)
                )
            )
            runner.start()
            streamer = threading.Thread(
                target=stream_lines, args=(url, {**long, "stream": True}, lines, started)
            )
            streamer.start()
            deadline = time.monotonic() + 60
            while (engine_gauge(url, "running"), engine_gauge(url, "waiting")) != (1, 1):
                assert time.monotonic() < deadline and not whole, _tail(log)
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            streamer.join(60)
            runner.join(60)
            assert proc.wait(60) == 0, _tail(log)
            assert lines[-1] == "[DONE]", lines[-3:]
            assert finish_reasons(lines) == ["abort"], lines[-3:]
            r = whole[0]
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "shutting_down"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def engine_gauge(url: str, which: str) -> int:
    return int(metric(httpx.get(url + "/metrics", timeout=10).text, f"num_requests_{which}"))


def test_second_signal_exits_at_once(tiny_llama, tmp_path):
    """A second SIGTERM does not wait for the (long) drain: the process exits with work unfinished."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": "Story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with open(tmp_path / "serve.log", "w+") as log:
        proc = start_serve(
            tiny_llama, port, url, log, "--max-num-seqs", "1", "--shutdown-timeout", "600", *LAZY
        )
        try:
            outs = [[] for _ in range(4)]  # one runs, three wait: minutes of work in all
            started = [threading.Event() for _ in outs]
            threads = [
                threading.Thread(target=stream_lines, args=(url, body, o, e))
                for o, e in zip(outs, started)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while not any(e.is_set() for e in started):  # one of them is streaming
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) is not None, _tail(log)
            for t in threads:
                t.join(60)
            assert "again: aborting all requests" in _tail(log)
            # exited with work unfinished: not every stream ran to its max_tokens
            assert sum(finish_reasons(o) == ["length"] for o in outs) < len(outs)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
