"""Issue 31: costly request work off the event loop, results unchanged. A large body is parsed on a
worker thread (its errors still name the field); the chunk or body carrying prompt logprobs is
built there too, and prompt logprobs come once per prompt, not once per choice, streamed or not."""

from __future__ import annotations

import json

import pytest

from jaxserve.server.streaming import dumps_yielding, sse


def test_large_bodies_parse_off_the_loop_with_the_same_answers(server, http):
    pad = {"metadata": {"note": "x" * (70 << 10)}}  # ignored, as OpenAI does: only the size counts
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **pad}
    assert len(json.dumps(body)) > 64 << 10  # past INLINE_PARSE_BYTES
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": "1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": "2", **pad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_streamed_prompt_logprobs_come_once_with_n_2(server, http):
    body = {"prompt": "hello there friend", "max_tokens": 2, "n": 2, "temperature": 1.0,
            "prompt_logprobs": 2, "seed": 1}
    whole = http.post("/v1/completions", json=body).json()
    want = next(c["prompt_logprobs"] for c in whole["choices"] if c["prompt_logprobs"])
    carried = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c.get("prompt_logprobs"):
                        carried.append(c["prompt_logprobs"])
    assert carried == [want]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, "n": 2, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"] and all("prompt_logprobs" not in c for c in chat["choices"])


def test_yielding_encoder_writes_what_json_dumps_writes():
    rows = [None] + [{str(j): {"logprob": -1.5 * j, "rank": j, "decoded_token": "t\u2028é\n"}
                      for j in range(3)} for _ in range(100)]
    body = {"id": "x", "choices": [{"index": 0, "text": "hé", "prompt_logprobs": rows,
                                    "token_ids": list(range(70)), "stop_reason": None}],
            "usage": {"prompt_tokens": 1, "ok": True}, "short": [[1, [2, {"a": []}]]]}
    assert dumps_yielding(body) == json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    assert sse(body, yielding=True) == sse(body)
    with pytest.raises(ValueError):  # as JSONResponse: no NaN in a body
        dumps_yielding({"a": [float("nan")] * 100})
