"""Multi-host: two CPU processes on 127.0.0.1 form one JAX cluster (jax.distributed + gloo), the
model is tensor-parallel over both processes' devices, process 0 schedules and broadcasts each step.
Greedy tokens must equal a single-process run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_process_tp_matches_single_process(tiny_model):
    model = tiny_model("llama")  # 4 heads, 2 kv heads: TP=2 across the two processes
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "multihost_demo.py"), "--model", model, "--processes", "2",
         "--devices-per-process", "1", "--max-tokens", "8", "--compare", "--timeout", "300"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["processes"] == 2 and result["tensor_parallel_size"] == 2
    assert result["single_process_tokens_match"] is True
    assert all(len(t) == 8 for t in result["tokens"])
    assert "ran" in proc.stdout  # the follower ran the broadcast steps
