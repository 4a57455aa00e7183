"""vLLM's `echo` on chat and `return_tokens_as_token_ids` (issue 31), over a real server with the
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logprob_token_ids_is_still_a_400(server, http, path):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CONT[:1]}
    r = http.post(path, json={**body, "max_tokens": 2, "logprob_token_ids": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text
