"""tools/device_check.py on CPU (--cpu-smoke): each phase in a child process, one JSON line per
result; a crashing child and a hanging one each lose one row and the run goes on; the first
child's LLM() imports none of the modules the device image lacks (the other children refuse them)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_children_isolated_crash_and_hang_lose_one_row(tmp_path):
    # --scale 4: generous deadlines on a loaded host (a clean checkout's first LLM() also builds
    # the CPU kernels); the hanging child's timeout is set on its own
    out = tmp_path / "dc.jsonl"
    proc = subprocess.run(
        [sys.executable, "tools/device_check.py", "--cpu-smoke", "--out", str(out),
         "--phases", "llm,env,copy,numerics", "--inject-crash", "env", "--scale", "4",
         "--inject-hang", "numerics:split_kv", "--timeouts", "numerics:split_kv=3"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # two rows failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    failed = [r for r in rows if r.get("ok") is False]
    assert [(r["phase"], r.get("unit")) for r in failed] == [("env", None), ("numerics", "split_kv")], failed
    assert failed[0]["why"] == "exit -11 (SIGSEGV)"
    assert failed[1]["why"] == "timeout after 3 s"

    # the first child: LLM() with default settings, then jax's backend; no grammar, no server
    (llm,) = [r for r in rows if r["phase"] == "llm" and "backend" in r]
    assert llm["ok"] and llm["backend"] == "cpu" and llm["tokens"] == 8
    assert llm["not_on_image_imported"] == []
    assert llm["accelerator_unused"] is None

    # the children after the crash ran, with starlette/uvicorn/gguf/llguidance blocked
    assert all(r["gbps"] > 0 for r in rows if r["phase"] == "copy" and "gbps" in r)
    checks = [r for r in rows if r["phase"] == "numerics" and "kernel" in r]
    assert {r["kernel"] for r in checks} == {"general"}
    assert all(r["ok"] and r["rel_err"] < 1e-2 for r in checks)
