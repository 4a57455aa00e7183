"""`jaxserve serve --data-parallel-size 3` behind SMG (the real `smg` binary from PyPI), tiny model.

One launch serves the whole module: the launcher prints SMG's command (--router none), then the test
starts SMG itself with round_robin and with cache_aware in turn over the same 3 replicas and runs
the same 6 conversations x 5 turns (distinct system prompts), reading each replica's
`vllm:prefix_cache_hits` and `vllm:prompt_tokens` to see where each request landed. Then it kills a
replica mid-run: no request fails (SMG retries elsewhere), and the launcher restarts it.
The acceptance run with the default model is bench/replicas.py (see bench/RESULTS.md).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import conversations
from jaxserve.server.replicas import smg_command

from .conftest import ENGINE, free_port

pytestmark = pytest.mark.skipif(shutil.which("smg") is None, reason="needs smg: pip install 'jaxserve[router]'")
N = 3


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("vllm:prefix_cache_hits", "vllm:prompt_tokens"):
            out[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def replica_pids(launcher: int) -> dict[int, int]:
    """port -> pid of the launcher's replica children."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue
        if ppid == launcher and "--port" in argv:
            out[int(argv[argv.index("--port") + 1])] = int(pid)
    return out


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    port = free_port()
    log = tmp_path_factory.mktemp("fleet") / "launcher.log"
    args = [sys.executable, "-m", "jaxserve.cli", "serve", model, "--port", str(port), "--data-parallel-size",
            str(N), "--router", "none", "--replica-max-restarts", "2", "--log-level", "warning"]
    for k, v in ENGINE.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while "route them with SMG" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "replicas not ready:\n" + log.read_text()[-3000:]
        time.sleep(1)
    urls = [f"http://127.0.0.1:{port + 1 + i}" for i in range(N)]
    yield proc, urls, log
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = smg_command(port, "127.0.0.1", urls, policy, None)
    cmd[cmd.index("--prometheus-port") + 1] = str(free_port())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "smg did not come up"
        time.sleep(0.5)


def converse(url: str, replicas: list[str], convs, turns: range, model: str) -> tuple[list[list[int]], int, int]:
    """Each conversation's turns in order, one request at a time; returns where each turn landed,
    failed requests, and prefix-hit tokens summed over the replicas."""
    before = {u: counters(u) for u in replicas}
    landed, failed = [[] for _ in convs], 0
    for c, conv in enumerate(convs):
        for turn in turns:
            snap = {u: counters(u)["vllm:prompt_tokens"] for u in replicas}
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": conv.prompt(turn), "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            if r.status_code != 200:
                failed += 1
                conv.answers.append("failed")
                continue
            conv.answers.append(r.json()["choices"][0]["text"].strip() or "ok")
            grew = [i for i, u in enumerate(replicas) if counters(u)["vllm:prompt_tokens"] > snap[u]]
            landed[c].append(grew[0] if len(grew) == 1 else -1)
    hits = sum(counters(u)["vllm:prefix_cache_hits"] - before[u]["vllm:prefix_cache_hits"] for u in replicas)
    return landed, failed, hits


def test_cache_aware_beats_round_robin_and_survives_a_dead_replica(fleet):
    proc, urls, log = fleet
    printed = [line for line in log.read_text().splitlines() if line.strip().startswith("smg launch")]
    assert printed and all(u in printed[0] for u in urls) and "--policy cache_aware" in printed[0]
    model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
    result = {}
    for policy in ("round_robin", "cache_aware"):
        for u in urls:
            assert httpx.post(u + "/reset_prefix_cache").status_code == 200
        convs = conversations.make("conversations", 6, 6, system_words=24, user_words=4, seed=1)
        smg, url = router(urls, policy)
        try:
            landed, failed, hits = converse(url, urls, convs, range(5), model)
            assert failed == 0
            result[policy] = (landed, hits)
            if policy == "cache_aware":  # kill the replica serving conversation 0, mid-run
                victim = urls[landed[0][-1]]
                port = int(victim.rsplit(":", 1)[1])
                old = replica_pids(proc.pid)[port]
                os.kill(old, signal.SIGKILL)
                _, failed, _ = converse(url, urls, convs, range(5, 6), model)
                assert failed == 0, "a request failed after a replica died"
                deadline = time.monotonic() + 300
                while not (replica_pids(proc.pid).get(port, old) != old and _healthy(victim)):
                    assert time.monotonic() < deadline, log.read_text()[-2000:]
                    time.sleep(1)
                assert "restarting (1/2)" in log.read_text()
        finally:
            smg.terminate()
            smg.wait(30)
    landed, hits_ca = result["cache_aware"]
    for turns in landed:  # every later turn lands where the conversation started
        assert turns[0] >= 0 and turns[1:] == [turns[0]] * 4, landed
    hits_rr = result["round_robin"][1]
    assert hits_ca >= 2 * hits_rr, (hits_ca, hits_rr, result)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_kv_event_ports_follow_vllms_rank_rule():
    from jaxserve.server.replicas import replica_argv

    assert replica_argv(["serve", "m", "--port", "9", "--data-parallel-size=3", "--router", "none",
                         "--max-model-len", "256"]) == ["serve", "m", "--max-model-len", "256"]
    assert re.search(r"--worker-urls http://a http://b --policy round_robin",
                     " ".join(smg_command(1, "h", ["http://a", "http://b"], "round_robin", None)))
