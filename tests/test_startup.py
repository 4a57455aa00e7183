"""Start-up: `jaxserve generate`'s KV cache sized for one sequence, serialized step executables
loaded without tracing (worker/step_cache.py), and `serve`'s background warm-up, during which
steps run only on compiled buckets (the step contract: no step waits on a compile)."""

from __future__ import annotations

import dataclasses
import threading

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.worker import step_cache, warm_up, xla_cache
from tests.test_step_contract import CompileCounter, steady_state_mix

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12] * 20]


def tokens(llm, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_generate_sizes_the_kv_cache_for_one_sequence(tiny_model):
    from jaxserve.engine import LLMEngine

    kw = dict(model=tiny_model("llama"), precompile=False, max_model_len=64, block_size=16)
    one = LLMEngine(kv_for_sequences=1, **kw)
    assert one.num_blocks == 4 + 0 + 2  # 64 tokens of 16, the watermark's share (0), null block + 1
    assert LLMEngine(kv_for_sequences=1, kv_cache_memory=2**20, **kw).num_blocks > one.num_blocks  # asked for


@pytest.fixture
def step_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_STEP_CACHE", "1")
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / step_cache.SUBDIR
    jax.config.update("jax_compilation_cache_dir", old)


def test_a_cached_step_loads_without_tracing_and_computes_the_same(tiny_model, step_cache_dir):
    kw = dict(SMALL, compilation_cache=False, precompile=False)
    first = LLM(tiny_model("llama"), **kw)
    want = tokens(first)
    runner = first.engine.runner  # one file per bucket's forward and one per shared sampler
    assert len(list(step_cache_dir.glob("*.bin"))) == len(runner.executables()) > runner.num_compiles > 0
    second = LLM(tiny_model("llama"), **kw)
    with CompileCounter() as compiles:
        assert tokens(second) == want
    assert compiles.count == 0  # nothing traced, lowered or compiled
    runner = second.engine.runner
    key = max(runner._compiled)
    same = step_cache.key_of(step_cache.describe(runner, key), key)
    runner.cfg = dataclasses.replace(runner.cfg, num_blocks=runner.cfg.num_blocks + 1)  # another KV cache
    assert step_cache.key_of(step_cache.describe(runner, key), key) != same


def test_a_step_xla_served_from_its_cache_is_not_stored(tiny_model, step_cache_dir, monkeypatch, tmp_path):
    """Serializing an executable that XLA's persistent cache deserialized leaves out its compiled
    functions (jax 0.10.2): stored, it loaded and then failed on its first call ("Function
    bitcast_dynamic-slice_fusion.2 not found"). A start with the step cache on after one with it off
    (XLA's cache warm) stores nothing, and the next start runs."""
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", str(tmp_path))  # LLM's XLA cache: the step cache's parent
    kw = dict(SMALL, compilation_cache=True, precompile=False)
    monkeypatch.setenv("JAXSERVE_STEP_CACHE", "0")
    want = tokens(LLM(tiny_model("llama"), **kw))  # XLA compiles (or its cache serves) every step
    monkeypatch.setenv("JAXSERVE_STEP_CACHE", "1")
    hits = xla_cache.EVENTS[xla_cache.HIT]
    assert tokens(LLM(tiny_model("llama"), **kw)) == want
    assert xla_cache.EVENTS[xla_cache.HIT] > hits  # XLA's cache served the steps this time
    assert not list(step_cache_dir.glob("*.bin"))
    assert tokens(LLM(tiny_model("llama"), **kw)) == want


@pytest.mark.slow
def test_during_the_background_warm_up_no_step_compiles(tiny_model, monkeypatch):
    llm = LLM(tiny_model("llama"), **SMALL, precompile=False)
    runner = llm.engine.runner
    gate = threading.Event()  # holds the background thread until the requests ran
    real = runner.executable

    def gated(key):
        if threading.current_thread().name == "jaxserve-warm-up":
            assert gate.wait(120)
        return real(key)

    monkeypatch.setattr(runner, "executable", gated)
    trims = []
    monkeypatch.setattr(warm_up.memory, "trim_heap", lambda: trims.append(1))
    warm = warm_up.warm_up(llm.engine)
    assert runner.num_compiles == 1 and runner.builder.ready is not None
    vocab = llm.engine.model_config.vocab_size
    mix = steady_state_mix(vocab)
    with CompileCounter() as compiles:
        got = tokens(llm)
        llm.generate(PROMPTS * 3, (mix * 2)[:9], use_tqdm=False)  # penalties, bias, logprobs: all on the largest
    assert compiles.count == 0 and runner.num_compiles == 1 and not warm.done
    gate.set()
    warm.join(300)
    assert warm.done  # server/heap.py freezes the heap at the engine's next idle moment
    assert runner.builder.ready is None and runner.num_compiles == len(runner.all_buckets())
    assert trims == [1]  # the compile's freed heap handed back once the warm-up is done
    assert tokens(llm) == got  # on the exact buckets now: the padded bucket computed the same greedy tokens


def test_native_cpu_kernels_compile_no_midpoint_buckets(tiny_llm):
    runner = tiny_llm.engine.runner
    assert runner.backend.token_midpoints == (runner.backend.attention != "cpu" or not runner.backend.native_linear)
    assert (48 in runner.builder.t_buckets) == runner.backend.token_midpoints
