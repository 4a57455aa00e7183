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


def test_bench_context_buckets_times_narrow_and_full_tables(tmp_path, tiny_model):
    from bench import context_buckets

    out = tmp_path / "context_buckets.json"
    assert context_buckets.main(["--model", tiny_model("llama"), "--max-model-len", "1024", "--block-size", "4",
                                 "--rows", "2", "--min-ctx", "10", "--max-ctx", "40", "--steps", "1",
                                 "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["results"]["cases"]
    assert len(cases) == 2 and all(c["narrow_c"] == 16 and c["full_c"] in (0, 256) for c in cases)
    assert all(c["narrow_ms"] > 0 and c["full_ms"] > 0 for c in cases)
