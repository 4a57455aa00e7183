"""Prompt logprobs over HTTP (real server, official client): completions' `echo` + `logprobs`
(OpenAI's legacy shape: the prompt's tokens first, the first without a logprob), `max_tokens=0`
with echo (lm-eval's log-likelihood request), and vLLM's `prompt_logprobs` on both endpoints."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.test_prompt_logprobs import reference

PROMPT = [5, 77, 140, 23, 9, 301, 44, 18, 250, 61, 7, 99]


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return reference(tiny_llama, PROMPT)


def want_logprobs(ref, ids):
    return ref[np.arange(len(ids) - 1), ids[1:]]


def test_lm_eval_loglikelihood_request(server, client, ref):
    """lm-eval's local-completions: echo=True, logprobs=1, max_tokens=0, temperature=0; it sums
    token_logprobs over the continuation and checks greediness against top_logprobs."""
    r = client.completions.create(model=server.model, prompt=PROMPT, echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == server.engine.tokenizer.decode(PROMPT) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want_logprobs(ref, PROMPT), atol=1e-4)
    ctxlen = 5  # as lm-eval parses it
    continuation = sum(lp.token_logprobs[ctxlen:])
    assert continuation == pytest.approx(want_logprobs(ref, PROMPT)[ctxlen - 1:].sum(), abs=1e-3)
    texts = server.engine.tokenizer
    for pos in range(ctxlen, len(PROMPT)):
        top = lp.top_logprobs[pos]
        assert texts.decode([PROMPT[pos]]) in top and 1 <= len(top) <= 2
        is_greedy = max(top.values()) == top[lp.tokens[pos]]
        assert is_greedy == (int(np.argmax(ref[pos - 1])) == PROMPT[pos])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs_puts_the_prompt_first(server, client, ref):
    kw = dict(model=server.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 4 and lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(PROMPT)], want_logprobs(ref, PROMPT), atol=1e-4)
    plain = client.completions.create(**{**kw, "echo": False}).choices[0].logprobs
    assert lp.tokens[len(PROMPT):] == plain.tokens
    np.testing.assert_allclose(lp.token_logprobs[len(PROMPT):], plain.token_logprobs, atol=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    # Streamed: the same values, the prompt's in the first chunk.
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], lp.token_logprobs[1:], atol=1e-6)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


def test_vllm_prompt_logprobs_field(server, client, ref):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    rows = r.choices[0].model_extra["prompt_logprobs"]
    assert len(rows) == len(PROMPT) and rows[0] is None
    for pos, row in enumerate(rows[1:], 1):
        mine = row[str(PROMPT[pos])]
        assert mine["logprob"] == pytest.approx(ref[pos - 1, PROMPT[pos]], abs=1e-4)
        top = sorted((v["rank"], int(k)) for k, v in row.items() if v["rank"] is not None and v["rank"] <= 3)
        assert [t for _, t in top] == np.argsort(-ref[pos - 1], kind="stable")[:3].tolist()
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    rows = chat.model_extra["prompt_logprobs"]
    assert rows[0] is None and all(len(r) == 1 for r in rows[1:])


def test_max_tokens_zero_needs_echo(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("bad", [-1, 21])
def test_bad_prompt_logprobs_is_a_400(server, client, bad):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": bad})
    assert e.value.body["param"] == "prompt_logprobs"
