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


def test_serve_cli_sigterm_drains(tiny_llama, tmp_path):
    """In-flight streams run to the end, new requests get 503, the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w+") as log:
        _run(tiny_llama, port, url, log)


def _run(tiny_llama, port: int, url: str, log) -> None:
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
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            "4MiB",
            "--served-model-name",
            "tiny",
            "--shutdown-timeout",
            "60",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, _tail(log)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, _tail(log)
            time.sleep(0.2)
        assert "Ready" in _tail(log) and url in _tail(log) and "KV cache" in _tail(log)

        results, first_chunk = [], threading.Event()

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
                        first_chunk.set()
            results.append((time.monotonic(), chunks))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
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
        for _, chunks in results:  # in-flight requests ran to the end
            assert chunks[-1] == "[DONE]"
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
