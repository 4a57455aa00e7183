"""`jaxserve serve --tensor-parallel-size 2` as a user starts it: a subprocess on 2 CPU devices,
answering the OpenAI completions endpoint with the same greedy text as a single-device engine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_starts_with_tensor_parallel_size(tiny_model, tmp_path):
    from jaxserve import LLM, SamplingParams

    model = tiny_model("llama", heads=4, kv_heads=2)
    prompt = "The capital of France is"
    engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=32)
    want = LLM(model, precompile=False, **engine).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model, "--port", str(port),
         "--tensor-parallel-size", "2", "--max-model-len", "128", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--kv-cache-memory", "4MiB", "--no-precompile",
         "--served-model-name", "tiny"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (log.seek(0), log.read())[1]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_server_refuses_more_shards_than_devices(tiny_model):
    """The flag reaches the engine: with one device, TP=2 is one clear error, not a silent TP=1."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", tiny_model("llama", heads=4, kv_heads=2),
         "--port", str(free_port()), "--tensor-parallel-size", "2", "--max-model-len", "128",
         "--kv-cache-memory", "4MiB", "--no-precompile"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "jaxserve: error:" in r.stderr and "device" in r.stderr.lower()
