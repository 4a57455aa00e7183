"""vLLM's `echo` on chat, `return_tokens_as_token_ids` and `logprob_token_ids` (issue 31), over a real server with the
official `openai` client: echo prepends the last message's content when its role is the reply's,
streamed (the delta after the role) and whole; token-id logprobs name every token "token_id:N",
on chat and completions, streamed too, with the same values as the plain logprobs."""

from __future__ import annotations

import pytest

CONT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
GREEDY = {"max_tokens": 4, "temperature": 0}


def chat(server, client, messages, **kw):
    return client.chat.completions.create(model=server.model, messages=messages, **GREEDY, **kw)


def test_chat_echo_prepends_last_assistant_message(server, client):
    body = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(server, client, CONT, extra_body=body).choices[0].message.content
    echoed = chat(server, client, CONT, extra_body={**body, "echo": True}).choices[0].message.content
    assert echoed == "Hello, I am" + plain
    stream = chat(server, client, CONT, stream=True, extra_body={**body, "echo": True})
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert deltas[0] == "Hello, I am"  # the first content delta: the echo
    assert "".join(deltas) == echoed


def test_chat_echo_skips_a_last_message_of_another_role(server, client):
    msgs = [{"role": "user", "content": "Say hi"}]
    plain = chat(server, client, msgs).choices[0].message.content
    assert chat(server, client, msgs, extra_body={"echo": True}).choices[0].message.content == plain


def ids_of(entry) -> int:
    assert entry.token.startswith("token_id:"), entry.token
    return int(entry.token.removeprefix("token_id:"))


def test_chat_tokens_as_token_ids(server, client):
    kw = {"logprobs": True, "top_logprobs": 3}
    plain = chat(server, client, CONT[:1], **kw).choices[0]
    r = chat(server, client, CONT[:1], **kw,
             extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    got = r.logprobs.content
    assert [ids_of(e) for e in got] == r.model_extra["token_ids"]
    assert [e.logprob for e in got] == [e.logprob for e in plain.logprobs.content]
    for e in got:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3 and all(t.token.startswith("token_id:") for t in e.top_logprobs)
    stream = chat(server, client, CONT[:1], stream=True, **kw,
                  extra_body={"return_tokens_as_token_ids": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in got]


def test_completions_tokens_as_token_ids(server, client):
    kw = {"model": server.model, "prompt": "hello there", "logprobs": 2, **GREEDY}
    plain = client.completions.create(**kw).choices[0].logprobs
    r = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True,
                                                    "return_token_ids": True}).choices[0]
    lp = r.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.model_extra["token_ids"]]
    assert lp.token_logprobs == plain.token_logprobs
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    stream = client.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_chat_logprob_token_ids_list_the_named_ids(server, client):
    """vLLM's logprob_token_ids: each token's top_logprobs are the named ids', in their order,
    with the values the natural top-N gives the same ids; an id outside the top-20 is below it."""
    msgs = CONT[:1]
    natural = chat(server, client, msgs, logprobs=True, top_logprobs=20,
                   extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content
    first = {ids_of(t): t.logprob for t in natural[0].top_logprobs}
    top = list(first)
    outside = next(t for t in range(1000) if t not in first)
    named = [top[2], top[0], outside]
    for stream in (False, True):
        r = chat(server, client, msgs, logprobs=True, stream=stream,
                 extra_body={"logprob_token_ids": named, "return_tokens_as_token_ids": True})
        got = ([e for c in r if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
               if stream else r.choices[0].logprobs.content)
        assert [ids_of(e) for e in got] == [ids_of(e) for e in natural]  # the same greedy tokens
        for e, nat in zip(got, natural):
            assert [ids_of(t) for t in e.top_logprobs] == named
            assert e.logprob == pytest.approx(nat.logprob, abs=1e-5)
        lp = [t.logprob for t in got[0].top_logprobs]
        assert lp[:2] == pytest.approx([first[top[2]], first[top[0]]], abs=1e-5)
        assert lp[2] <= min(first.values()) + 1e-5


def test_completions_logprob_token_ids(server, client):
    kw = {"model": server.model, "prompt": "hello there", **GREEDY}
    r = client.completions.create(**kw, extra_body={"logprob_token_ids": [7, 3], "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    for tok, top in zip(lp.tokens, lp.top_logprobs):  # the sampled token first, as for the top-N
        assert list(top)[0] == tok and [k for k in top if k != tok] == [
            k for k in ("token_id:7", "token_id:3") if k != tok]
        assert all(v <= 0 for v in top.values())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,param", [
    ({"logprob_token_ids": [1, 10**7]}, "logprob_token_ids"),  # outside the vocabulary
    ({"logprob_token_ids": list(range(21))}, "logprob_token_ids"),  # past MAX_LOGPROBS
    ({"logprob_token_ids": []}, "logprob_token_ids"),
    ({"logprob_token_ids": [1, 2], "top": 3}, "top"),  # a count that is not the ids'
])
def test_logprob_token_ids_bad_values_are_400s(server, http, path, extra, param):
    chat_path = path.endswith("chat/completions")
    body = {"messages": CONT[:1], "logprobs": True} if chat_path else {"prompt": "x"}
    top = "top_logprobs" if chat_path else "logprobs"
    if "top" in extra:
        extra = {"logprob_token_ids": extra["logprob_token_ids"], top: extra["top"]}
    r = http.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == (top if param == "top" else param), r.text
