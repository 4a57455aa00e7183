"""A default Pallas attention backend whose kernels the compiler rejects falls back to `xla` once,
with one warning, and serves the same tokens; a requested one gets the compiler's error; a KV
layout change once the cache holds data is an error naming the flag (runtime/fallback.py).

The Pallas backend here is the TPU kernel interpreted on CPU (its tpu-fused KV layout), made to
fail at lowering the way Mosaic rejects a kernel; `fallback="xla"` is what `resolve_backend` sets
for the default Pallas backend on a GPU or TPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import pallas_kernels
from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.model.loader import load_model
from jaxserve.runtime.backend import Backend, resolve_backend
from jaxserve.worker.runner import ModelRunner, RunnerConfig

CFG = RunnerConfig(block_size=16, num_blocks=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 7, 19, 31], [9, 8, 7, 6, 5]]
BLOCKS = [[3, 4, 5, 6], [9, 10, 11, 12]]


def pallas(fallback: str | None) -> Backend:
    return Backend("cpu", "pallas", "tpu-fused", False, False, "default (test)", fallback=fallback)


@pytest.fixture
def broken_kernel(monkeypatch):
    calls = []

    def reject(*args, **kw):
        calls.append(1)
        raise RuntimeError("Mosaic failed to compile TPU kernel: scoped VMEM exhausted (injected)\nmore lines")

    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention", reject)
    return calls


def greedy(runner: ModelRunner, steps: int = 4) -> list[list[int]]:
    seqs, starts = [list(p) for p in PROMPTS], [0, 0]
    for step in range(steps):
        rows = [RowSpec(s, st, len(s) - st, b, Sampling(step=step)) for s, st, b in zip(seqs, starts, BLOCKS)]
        batch, key, _ = runner.builder.build(rows)
        tokens = runner.fetch(runner.execute(batch, key), key.s, False)[0][:2]
        starts = [len(x) for x in seqs]
        for x, t in zip(seqs, tokens):
            x.append(int(t))
    return [s[len(p):] for s, p in zip(seqs, PROMPTS)]


def test_a_default_pallas_backend_that_fails_to_compile_serves_on_xla(tiny_model, broken_kernel, caplog):
    lm = load_model(tiny_model("llama"))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        runner = ModelRunner(lm.config, lm.params, CFG, backend=pallas("xla"))
        keys = runner.all_buckets()[:2]
        runner.precompile(workers=2, keys=keys)  # both fail concurrently: one switch, one warning
    warned = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "injected" in warned[0] and "--attention-backend xla" in warned[0] and "more lines" not in warned[0]
    assert broken_kernel, "the injected kernel was never traced"
    assert (runner.backend.attention, runner.backend.kv_layout, runner.kv.layout) == ("xla", "paged", "paged")
    assert runner.builder.context_widths == [4]  # the builder takes xla's bucket dimensions (64 tokens of 16)
    assert set(runner._compiled) == set(keys) and runner.num_compiles == 2
    xla = ModelRunner(lm.config, lm.params, CFG, backend=resolve_backend("xla", CFG.dtype, CFG.dtype))
    assert greedy(runner) == greedy(xla)


def test_a_requested_pallas_backend_gets_the_compilers_error(tiny_model, broken_kernel):
    lm = load_model(tiny_model("llama"))
    runner = ModelRunner(lm.config, lm.params, CFG, backend=pallas(None))
    with pytest.raises(RuntimeError, match="injected"):
        runner.executable(runner.all_buckets()[0])
    assert runner.backend.attention == "pallas"


def test_no_layout_switch_once_the_cache_holds_data(tiny_model, monkeypatch):
    lm = load_model(tiny_model("llama"))
    runner = ModelRunner(lm.config, lm.params, CFG, backend=pallas("xla"))
    runner.steps_run = 1  # a step has written KV in the fused layout
    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("Mosaic rejected it (injected)")))
    runner._use_backend(runner.backend)  # models rebuilt with the patched kernel
    with pytest.raises(RuntimeError, match="start with --attention-backend xla"):
        runner.executable(runner.all_buckets()[0])
    assert runner.backend.kv_layout == "tpu-fused"


def test_resolve_backend_sets_the_fallback_only_for_the_default():
    from jaxserve.runtime.backend import KernelShape

    shape = KernelShape(64, 2, 16)
    default = resolve_backend(None, "bfloat16", "bfloat16", 1, shape, target="gpu", compute_capability="9.0")
    asked = resolve_backend("pallas", "bfloat16", "bfloat16", 1, shape, target="gpu", compute_capability="9.0")
    assert (default.attention, default.fallback) == ("pallas", "xla")
    assert (asked.attention, asked.fallback) == ("pallas", None)
    assert np.all([resolve_backend("xla", "bfloat16", "bfloat16", 1, shape, target="tpu").fallback is None])
