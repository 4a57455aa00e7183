"""Endpoints, fields and headers vLLM users rely on (issue 18), and the validation that lets through.

All on the shared tiny-model server, through the official client where it can send the request.
"""

from __future__ import annotations

import threading

import openai
import pytest

NO_SPECIAL = {"0": -100, "1": -100, "2": -100}  # keep the tiny model off its special tokens
MSG = [{"role": "user", "content": "Hi there"}]


def test_load_counts_generate_calls_in_flight(server, http):
    assert http.get("/load").json() == {"server_load": 0}
    with server.paused():  # the engine holds: the request stays in flight
        done = []
        t = threading.Thread(
            target=lambda: done.append(
                http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            )
        )
        t.start()
        while http.get("/load").json()["server_load"] != 1:
            t.join(0.01)
        assert not done
    t.join(30)
    assert done[0].status_code == 200
    assert http.get("/load").json() == {"server_load": 0}


def test_invocations_routes_chat_and_completion_bodies(server, http):
    r = http.post("/invocations", json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    chat = http.post(
        "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "temperature": 0}
    )
    assert r.json()["choices"][0]["message"] == chat.json()["choices"][0]["message"]
    r = http.post("/invocations", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = http.post("/invocations", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("side,keep", [("left", slice(-4, None)), ("right", slice(0, 4))])
def test_truncate_prompt_tokens(server, client, side, keep):
    ids = server.engine.tokenizer.encode("one two three four five six seven eight")
    assert len(ids) > 4
    r = client.completions.create(
        model=server.model,
        prompt=ids,
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side},
    )
    assert r.choices[0].prompt_token_ids == ids[keep] and r.usage.prompt_tokens == 4


def test_truncate_prompt_tokens_lets_long_prompts_in(server, client):
    long = "one two three four five six seven eight nine ten " * 40  # > max_model_len tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=long, max_tokens=2)
    r = client.completions.create(
        model=server.model, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100}
    )
    assert r.usage.prompt_tokens == 100
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": long}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": -1},  # -1: as much as leaves room for the output
    )
    assert r.usage.prompt_tokens == server.engine.max_model_len - 2


def test_return_token_ids_whole_and_streamed(server, client):
    tok = server.engine.tokenizer
    kw = {"model": server.model, "max_tokens": 6, "temperature": 0, "logit_bias": NO_SPECIAL}
    extra = {"return_token_ids": True, "ignore_eos": True}
    r = client.completions.create(prompt="Hello world", extra_body=extra, **kw)
    c = r.choices[0]
    assert c.prompt_token_ids == tok.encode("Hello world") and len(c.token_ids) == 6
    assert tok.decode(c.token_ids) == c.text
    streamed, prompt_ids = [], []
    for chunk in client.completions.create(
        prompt="Hello world", stream=True, extra_body=extra, **kw
    ):
        ch = chunk.choices[0]
        streamed += ch.token_ids
        prompt_ids += getattr(ch, "prompt_token_ids", None) or []
    assert streamed == c.token_ids and prompt_ids == c.prompt_token_ids
    r = client.chat.completions.create(messages=MSG, extra_body=extra, **kw)
    assert r.prompt_token_ids == tok.apply_chat_template(MSG)
    assert len(r.choices[0].token_ids) == 6
    plain = client.completions.create(prompt="Hello world", **kw).choices[0]
    assert getattr(plain, "token_ids", None) is None  # only when asked for


def test_content_as_text_parts(server, client):
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    kw = {"model": server.model, "max_tokens": 4, "temperature": 0}
    a = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    b = client.chat.completions.create(messages=MSG, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(server, client, chat):
    kw = {
        "model": server.model,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "extra_body": {"min_tokens": 5},
    }
    if chat:
        stream = client.chat.completions.create(messages=MSG, **kw)
    else:
        stream = client.completions.create(prompt="Hello", **kw)
    chunks = list(stream)
    last = 0
    for ch in chunks:
        u = ch.usage
        assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= last
        last = u.completion_tokens
    assert last == 5 and chunks[-1].choices == []


def test_logprobs_zero_gives_the_sampled_token(server, client):
    """vLLM: logprobs=0 returns each sampled token's logprob (and nothing else)."""
    r = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(top) == 1 for top in lp.top_logprobs)
    assert [next(iter(top.values())) for top in lp.top_logprobs] == lp.token_logprobs
    assert [next(iter(top)) for top in lp.top_logprobs] == lp.tokens
    r = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    for tok, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs):
        assert 3 <= len(top) <= 4 and tok in top  # the sampled token is always there


@pytest.mark.parametrize("seed", [-(2**63), -2, 0, 2**32, 2**63 - 1])
def test_seeds_in_the_64_bit_range_are_accepted(server, client, seed):
    kw = {
        "model": server.model,
        "prompt": "Hello",
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": seed,
    }
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


def test_custom_roles_pass_through(server, http):
    """A role the model's template accepts is rendered (vLLM); the template decides."""
    msgs = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == server.engine.tokenizer.apply_chat_template(msgs)
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_empty_and_out_of_vocab_prompts_use_vllm_wording(server, client):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=server.model, prompt=[999999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=server.model, prompt=[[1, 2], [3, -1]], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="", max_tokens=2)
    assert e.value.body["param"] == "prompt"


def test_harmless_values_of_unsupported_fields_pass(server, http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": MSG,
            "max_tokens": 2,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "tools": [],
            "best_of": 1,
            "prompt_logprobs": None,
            "user": "someone",
            "metadata": {"k": "v"},
        },
    )
    assert r.status_code == 200, r.text


def test_continue_final_message(server, http):
    """vLLM's extension: the prompt ends inside the last (assistant) message, to be continued."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    body = {
        "messages": msgs,
        "max_tokens": 2,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    expect = server.engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=False, continue_final_message=True
    )
    assert r.json()["usage"]["prompt_tokens"] == len(expect)
    assert server.engine.tokenizer.decode(expect).endswith("Hello, I am")
    r = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
