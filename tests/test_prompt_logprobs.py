"""Prompt logprobs (`SamplingParams.prompt_logprobs`; the server's `echo` + `logprobs` and
`prompt_logprobs`): one per prompt token, the first None, computed as logits rows of the prefill.
They equal one uncached forward pass over the same tokens within 1e-4 whatever the chunking, cache
hits, preemptions or neighbours, and a scored prompt never comes from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.errors import UserError
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free

N_TOP = 3


def reference(path, ids):
    """log_softmax of one forward pass over all of ids (one chunk, no cache) at every position."""
    lm = load_model(path)
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=16, num_blocks=16, max_model_len=128, max_num_seqs=64, max_num_batched_tokens=64))
    row = RowSpec(ids, 0, len(ids), list(range(1, 6)), None, extra=[(p, Sampling()) for p in range(len(ids) - 1)])
    batch, key, _ = runner.builder.build([row])
    logits = np.asarray(runner.forward_logits(batch, key), np.float64)[: len(ids) - 1]
    return (logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True))


def check(out, ids, ref):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    got = np.array([lp.logprob for lp in lps[1:]])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    for p, lp in enumerate(lps[1:]):
        assert lp.token_id == ids[p + 1]
        top = [t for t, _ in lp.top]
        assert len(top) == N_TOP and top == np.argsort(-ref[p], kind="stable")[:N_TOP].tolist()


@pytest.fixture(scope="module")
def prompts(tiny_model):
    rng = np.random.default_rng(5)
    vocab = load_model(tiny_model("llama")).config.vocab_size
    ids = [rng.integers(3, vocab, size=n).tolist() for n in (60, 37, 2, 17)]
    return ids, [reference(tiny_model("llama"), p) for p in ids]


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=16),  # chunked prefill: several steps of logits rows
    dict(max_num_batched_tokens=64, max_num_seqs=4),  # few logits rows per step: chunks cut to fit
    dict(num_blocks=12, prefix_cache="off"),  # a small cache: preemptions
], ids=["chunked", "row-budget", "preempting"])
def test_prompt_logprobs_equal_a_forward_pass(tiny_model, prompts, kw):
    ids, refs = prompts
    llm = LLM(tiny_model("llama"), **{**ENGINE_KW, **kw})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=N_TOP)
    others = [np.random.default_rng(i).integers(3, 300, size=40).tolist() for i in range(6)]
    outs = llm.generate(ids + others, [params] * len(ids) + [SamplingParams(max_tokens=20, temperature=0)] * 6,
                        use_tqdm=False)
    for out, p, ref in zip(outs, ids, refs):
        check(out, p, ref)
        assert len(out.outputs[0].token_ids) == 8
    assert all(o.prompt_logprobs is None for o in outs[len(ids):])
    assert_all_blocks_free(llm)


def test_a_cached_prompt_is_scored_in_full(tiny_model, prompts):
    ids, refs = prompts
    llm = LLM(tiny_model("llama"), **ENGINE_KW)
    plain = llm.generate([ids[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    again = llm.generate([ids[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prompt's full blocks are cached
    scored = llm.generate([ids[0]], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=N_TOP),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # not served from the cache (as vLLM)
    check(scored, ids[0], refs[0])
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_n_sequences_share_one_scored_prompt(tiny_llm, prompts):
    ids, refs = prompts
    out = tiny_llm.generate([ids[1]], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3,
                                                     prompt_logprobs=N_TOP), use_tqdm=False)[0]
    check(out, ids[1], refs[1])
    assert len(out.outputs) == 3


def test_scoring_changes_no_generated_token(tiny_llm, prompts):
    ids, _ = prompts
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    plain = tiny_llm.generate(ids, SamplingParams(**greedy), use_tqdm=False)
    scored = tiny_llm.generate(ids, SamplingParams(**greedy, prompt_logprobs=0), use_tqdm=False)
    for a, b in zip(plain, scored):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([lp.logprob for lp in a.outputs[0].logprobs],
                                   [lp.logprob for lp in b.outputs[0].logprobs], atol=1e-5)
        assert all(lp is None or lp.top == [] for lp in b.prompt_logprobs)  # 0: just the prompt token


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3"])
def test_bad_prompt_logprobs_is_refused(bad):
    with pytest.raises(UserError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
