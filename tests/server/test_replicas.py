"""`jaxserve serve --data-parallel-size 3` behind SMG (the real `smg` binary from PyPI).

Runs bench/replicas.py's acceptance flow once, on the tiny random model (3 replicas of the default
model take many minutes to start on 2 cores; bench/RESULTS.md has that run): the launcher prints
SMG's command, SMG fronts the same 3 replicas with round_robin and then cache_aware for 6
conversations x 5 turns (distinct system prompts); each turn's landing replica and the prefix-hit
tokens come from the replicas' own `vllm:` metrics. Then the replica holding conversation 0 is
killed mid-run: no request fails (SMG retries elsewhere), and the launcher restarts it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil

import pytest

from bench import replicas as bench_replicas
from jaxserve.server.replicas import rank_flags, replica_argv, smg_command

from .conftest import ENGINE

N = 3


@pytest.mark.skipif(shutil.which("smg") is None, reason="needs smg: pip install 'jaxserve[router]'")
def test_cache_aware_beats_round_robin_and_survives_a_dead_replica(tiny_model, tmp_path):
    args = [tiny_model("llama")] + [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    log = tmp_path / "launcher.log"
    res = bench_replicas.run(args, N, num_conversations=6, turns=5, system_words=8, user_words=2, max_tokens=3,
                             num_blocks=ENGINE["num_blocks"], log_path=str(log))
    printed = [line for line in log.read_text().splitlines() if line.strip().startswith("smg launch")]
    assert printed and "--policy cache_aware" in printed[0] and printed[0].count("--worker-urls") == 1
    rr, ca = res["policies"]["round_robin"], res["policies"]["cache_aware"]
    assert rr["failed"] == ca["failed"] == 0
    assert all(turns[0] >= 0 and turns == [turns[0]] * 5 for turns in ca["landed"]), ca["landed"]
    assert len({turns[0] for turns in ca["landed"]}) == N  # new conversations spread over the replicas
    assert [i for t in rr["landed"] for i in t] != [t[0] for t in rr["landed"] for _ in t]  # rr scatters
    assert ca["hit_tokens"] >= 2 * rr["hit_tokens"] > 0, (ca["hit_tokens"], rr["hit_tokens"])
    assert ca["after_kill_failed"] == 0 and ca["restarted"]
    assert "restarting (1/2)" in log.read_text()
    for r in (rr, ca):  # the simulator's prediction for this very trace
        assert abs(r["predicted_hit_ratio"] - r["hit_ratio"]) <= 0.1 * r["hit_ratio"], r


def test_replica_argv_and_smg_command():
    assert replica_argv(["serve", "m", "--port", "9", "--data-parallel-size=3", "--router", "none",
                         "--max-model-len", "256", "--profiler-dir", "/p"]) == ["serve", "m", "--max-model-len", "256"]
    args = argparse.Namespace(port=9, profiler_dir="/p", kv_events_config='{"endpoint": "tcp://*:5557"}')
    flags = rank_flags(args, 1)
    assert flags[:2] == ["--port", "11"] and flags[-2:] == ["--profiler-dir", "/p/replica1"]
    assert json.loads(flags[3])["endpoint"] == "tcp://*:5558"
    assert rank_flags(argparse.Namespace(port=9, profiler_dir=None, kv_events_config=None), 0) == ["--port", "10"]
    assert re.search(r"--worker-urls http://a http://b --policy round_robin",
                     " ".join(smg_command(1, "h", ["http://a", "http://b"], "round_robin", None)))
