"""tools/device_check.py runs end to end on CPU (--cpu-smoke) and writes one JSON line per result."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_every_phase(tmp_path):
    out = tmp_path / "dc.jsonl"
    proc = subprocess.run(
        [sys.executable, "tools/device_check.py", "--cpu-smoke", "--out", str(out),
         "--phases", "env,copy,numerics"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["phase"] for r in rows} == {"env", "copy", "numerics"}
    checks = [r for r in rows if r["phase"] == "numerics" and "kernel" in r]
    assert {r["kernel"] for r in checks} == {"general", "split_kv"}
    assert all(r["ok"] and r["rel_err"] < 1e-2 for r in checks)
    assert all(r["gbps"] > 0 for r in rows if r["phase"] == "copy" and "gbps" in r)
