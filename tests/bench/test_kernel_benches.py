"""`jaxserve bench attention` and `bench matmul` run end to end and write their JSON (no timing
asserts: the figures only have to be positive and finite)."""

from __future__ import annotations

import json
import math

import pytest

from bench import attention, matmul
from jaxserve.runtime import cpu_kernels


def test_bench_attention_writes_every_case(tmp_path):
    out = tmp_path / "attention.json"
    backends = "xla" if cpu_kernels.available() else "cpu,xla"
    assert attention.main(["--backends", backends, "--kv-dtypes", "float32", "--layers", "1", "--repeats", "1",
                           "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["results"]["cases"]
    assert len(cases) == len(backends.split(",")) * len(attention.CASES)
    assert all(c["ms"] > 0 and math.isfinite(c["gflops"]) and c["kv_gbps"] > 0 for c in cases)


@pytest.mark.skipif(cpu_kernels.available() is not None, reason="native kernels unavailable")
def test_bench_matmul_compares_xla_and_native(tmp_path):
    out = tmp_path / "matmul.json"
    assert matmul.main(["--rows", "1,8", "--weights", "1", "--repeats", "1", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["results"]["cases"]
    assert {(c["k"], c["n"], c["m"]) for c in cases} == {(k, n, m) for k, n in matmul.SHAPES for m in (1, 8)}
    assert all(c["xla_gflops"] > 0 and c["native_gflops"] > 0 for c in cases)
