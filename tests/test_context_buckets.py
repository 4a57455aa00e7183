"""The xla attention path's block table is as wide as the step's context bucket, not max_model_len
(issue 24 item 7): `BucketKey.c`, chosen by the batch builder where `Backend.context_buckets` says
so. The same tokens and logprobs as the full-width table (forced in the same process by turning the
builder's context buckets off), a step of short contexts on a narrow table, a sequence that grows
past a width moving to the next one, and the native CPU and Pallas backends keeping their buckets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.batch import BatchBuilder, RowSpec, Sampling
from jaxserve.core.buckets import BucketKey
from jaxserve.model.loader import load_model
from jaxserve.runtime.backend import Backend, KernelShape, resolve_backend
from jaxserve.worker.runner import ModelRunner, RunnerConfig

# block size 4 so a few hundred tokens span several widths: 128 blocks -> widths 16, 32, 64, 128
CFG = RunnerConfig(block_size=4, num_blocks=400, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                   attention_backend="xla")
BLOCKS_PER_SEQ = 130


@pytest.fixture(scope="module")
def xla_runner(tiny_model):
    lm = load_model(tiny_model("llama"))
    return ModelRunner(lm.config, lm.params, CFG)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Each prompt prefilled alone in chunks of 64, then `steps` greedy decode steps of all of them
    together: (generated tokens, the decode steps' keys and block-table widths, top-5 logprobs of
    every sampled row)."""
    seqs = [list(p) for p in prompts]
    blocks = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))]
    logprobs, decode_keys = [], []

    def run(rows):
        batch, key, rowmap = runner.builder.build(rows)
        out = runner.fetch(runner.execute(batch, key), key.s, logprobs=True)
        logprobs.append(np.asarray(out.top_logprobs)[rowmap.out])
        return key, batch.block_tables.shape, [int(out.tokens[i]) for i in rowmap.out]

    for s, b in zip(seqs, blocks):
        for start in range(0, len(s), 64):
            n = min(64, len(s) - start)
            last = start + n == len(s)
            _, _, tok = run([RowSpec(s, start, n, b, Sampling(num_logprobs=5) if last else None)])
        s.append(tok[0])
    for step in range(steps):
        rows = [RowSpec(s, len(s) - 1, 1, b, Sampling(step=step + 1, num_logprobs=5)) for s, b in zip(seqs, blocks)]
        key, shape, toks = run(rows)
        decode_keys.append((key, shape))
        for s, t in zip(seqs, toks):
            s.append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts)], decode_keys, np.concatenate(logprobs)


def full_width(runner: ModelRunner, *args):
    runner.builder.context_buckets = False
    try:
        return greedy(runner, *args)
    finally:
        runner.builder.context_buckets = runner.backend.context_buckets


def test_short_contexts_take_a_narrow_table_with_the_same_tokens(xla_runner):
    assert xla_runner.backend.context_buckets and xla_runner.builder.context_widths == [16, 32, 64, 128]
    prompts = [prompt(9, 1), prompt(21, 2)]
    got, keys, lp = greedy(xla_runner, prompts, steps=6)
    assert {(k.c, shape) for k, shape in keys} == {(16, (2, 16))}  # 31 tokens or fewer: 8 blocks, width 16
    want, full_keys, want_lp = full_width(xla_runner, prompts, 6)
    assert {(k.c, shape) for k, shape in full_keys} == {(0, (2, 128))}
    assert got == want
    np.testing.assert_array_equal(lp, want_lp)


def test_a_sequence_crossing_a_width_moves_to_the_next_one(xla_runner):
    """58 prompt tokens and the first sampled one: decode steps at contexts 59..68; from 65 (17
    blocks of 4) the step needs width 32."""
    prompts = [prompt(58, 3), prompt(5, 4)]
    got, keys, lp = greedy(xla_runner, prompts, steps=10)
    contexts = [59 + i for i in range(10)]  # the longest context of each decode step
    assert [k.c for k, _ in keys] == [16 if c <= 64 else 32 for c in contexts]
    assert [shape for _, shape in keys] == [(2, k.c) for k, _ in keys]
    want, _, want_lp = full_width(xla_runner, prompts, 10)
    assert got == want
    np.testing.assert_array_equal(lp, want_lp)


def test_long_contexts_take_the_wide_tables_with_the_same_tokens(xla_runner):
    prompts = [prompt(300, 5), prompt(7, 6), prompt(130, 7)]
    got, keys, lp = greedy(xla_runner, prompts, steps=4)
    assert {k.c for k, _ in keys} == {128}  # 301+ tokens: 76+ blocks
    want, _, want_lp = full_width(xla_runner, prompts, 4)
    assert got == want
    np.testing.assert_array_equal(lp, want_lp)
    assert {k.c for k in xla_runner._compiled} >= {16, 32, 128}


def test_engine_greedy_tokens_and_logprobs_match_the_full_table(tiny_model):
    """Through the scheduler and planner (chunked prefill, mixed steps): bucketed vs full width."""
    llm = LLM(tiny_model("llama"), precompile=False, attention_backend="xla", block_size=4, max_model_len=512,
              max_num_seqs=8, max_num_batched_tokens=64, num_blocks=600, prefix_cache="off")
    runner = llm.engine.runner
    assert runner.builder.context_widths == [16, 32, 64, 128]
    prompts = [prompt(6, 8), prompt(60, 9), prompt(250, 10), prompt(17, 11)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)

    def outputs():
        return [(o.outputs[0].token_ids, [(t.logprob, t.top) for t in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    got = outputs()
    widths = {k.c for k in runner._compiled}
    assert {16, 32, 64} <= widths and 0 not in widths
    runner.builder.context_buckets = False
    want = outputs()
    assert {k.c for k in runner._compiled} - widths == {0}
    assert got == want


def test_native_cpu_and_pallas_backends_keep_their_buckets(tiny_model):
    lm = load_model(tiny_model("llama"))
    cfg = RunnerConfig(block_size=4, num_blocks=64, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)
    runner = ModelRunner(lm.config, lm.params, cfg)  # the default on CPU: the native kernels
    assert runner.backend.attention == "cpu" and not runner.backend.context_buckets
    plain = BatchBuilder(max_num_batched_tokens=64, max_num_seqs=4, block_size=4, max_model_len=512,
                         vocab_size=lm.config.vocab_size)
    plain.set_token_midpoints(runner.backend.token_midpoints)  # none on native CPU (tests/test_startup.py)
    assert runner.all_buckets() == plain.all_buckets() and all(k.c == 0 for k in runner.all_buckets())
    batch, key, _ = runner.builder.build([RowSpec(prompt(9, 1), 0, 9, [1, 2, 3], Sampling())])
    assert key == BucketKey(16, 1, 0) and batch.block_tables.shape == (1, 128)
    xla = ModelRunner(lm.config, lm.params, dataclasses.replace(cfg, attention_backend="xla"))
    plain.set_token_midpoints(True)  # xla pays for padding rows: it keeps the midpoints
    assert len(xla.all_buckets()) == 4 * len(plain.all_buckets())
    shape = KernelShape(64, 2, 16)
    gpu = resolve_backend(None, "bfloat16", "bfloat16", 1, shape, target="gpu", compute_capability="9.0")
    old_gpu = resolve_backend(None, "bfloat16", "bfloat16", 1, shape, target="gpu", compute_capability="8.0")
    tpu = resolve_backend(None, "bfloat16", "bfloat16", 1, shape, target="tpu")
    assert (gpu.attention, gpu.context_buckets) == ("pallas", False)
    assert (tpu.attention, tpu.context_buckets) == ("pallas", False)
    assert (old_gpu.attention, old_gpu.context_buckets) == ("xla", True)  # the portable path below sm_90
    assert not Backend("cpu", "pallas", "tpu-fused", False, False, "interpreted").context_buckets
