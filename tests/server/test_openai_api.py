"""The OpenAI API through the official client: completions and chat, streamed and not."""

from __future__ import annotations

import pytest

NO_SPECIAL = {"0": -100, "1": -100, "2": -100}  # keep the tiny model off its special tokens


def test_models_version_health(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].max_model_len == 256
    assert client.models.retrieve(server.model).id == server.model
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


def test_completion_basic_and_usage(server, client):
    r = client.completions.create(
        model=server.model,
        prompt="The capital of France",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.finish_reason == "length" and c.index == 0
    u = r.usage
    assert u.completion_tokens == 8
    assert u.prompt_tokens == len(server.engine.tokenizer.encode("The capital of France"))
    assert u.prompt_tokens + u.completion_tokens == u.total_tokens


def test_completion_prompt_forms(server, client):
    tok = server.engine.tokenizer
    ids = tok.encode("one, two, three")
    kw = {
        "model": server.model,
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    by_text = client.completions.create(prompt="one, two, three", **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    r = client.completions.create(prompt=["one, two, three", "JAX is"], **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == by_text
    sampled = {**kw, "temperature": 1.0, "seed": 3}
    r = client.completions.create(prompt=["one, two, three", "JAX is"], n=2, **sampled)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    r = client.completions.create(prompt=[ids, tok.encode("JAX is")], **kw)
    assert r.choices[0].text == by_text and len(r.choices) == 2
    assert r.usage.prompt_tokens == len(ids) + len(tok.encode("JAX is"))
    assert r.usage.completion_tokens == 10


def test_streamed_equals_whole_and_usage_chunk(server, client):
    kw = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0.9,
        "seed": 7,
        "n": 2,
        "extra_body": {"logit_bias": NO_SPECIAL},
    }
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
        assert ch.usage is None
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for i in (0, 1):
        assert texts[i] == whole.choices[i].text
        assert finishes[i] == [whole.choices[i].finish_reason]  # exactly once
    assert whole.choices[0].text != whole.choices[1].text  # n siblings get different seeds


def test_every_token_streams_a_chunk_even_while_its_text_is_held_back(server, client):
    # As vLLM streams: one chunk per generated token, with empty text while the text is held back
    # (here: the text's tail could still become the stop string, which never completes), so the
    # client sees each token arrive
    kw = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
          "extra_body": {"ignore_eos": True, "logit_bias": NO_SPECIAL}}
    whole = client.completions.create(**kw).choices[0].text
    held = whole[len(whole) // 2:]
    assert held
    chunks = [ch for ch in client.completions.create(stream=True, stop=[held + "\u0001"], **kw) if ch.choices]
    assert len(chunks) == 16
    assert sum(not ch.choices[0].text for ch in chunks) >= 1  # held back, streamed empty
    assert "".join(ch.choices[0].text for ch in chunks) == whole


def test_seed_reproducible(server, client):
    kw = {
        "model": server.model,
        "prompt": "Numbers 12345",
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 0.9,
    }
    a = client.completions.create(seed=123, **kw).choices[0].text
    assert client.completions.create(seed=123, **kw).choices[0].text == a
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others != {a}


def test_stop_strings(server, client):
    kw = {
        "model": server.model,
        "prompt": "The capital of Italy",
        "max_tokens": 30,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:8]
    assert stop.strip(), full
    r = client.completions.create(stop=[stop, "never-there"], **kw).choices[0]
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)] and stop not in r.text
    assert r.model_extra.get("stop_reason") == stop
    r = client.completions.create(
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        **{k: v for k, v in kw.items() if k != "extra_body"},
    ).choices[0]
    assert r.text == full[: full.index(stop) + len(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw)
    )
    assert streamed == full[: full.index(stop)]


def test_completion_logprobs_and_echo(server, client):
    r = client.completions.create(
        model=server.model,
        prompt="Caf\u00e9 is",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy picks the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    r = client.completions.create(
        model=server.model, prompt="Caf\u00e9 is", max_tokens=4, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("Caf\u00e9 is")
    s = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=server.model,
            prompt="Caf\u00e9 is",
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
        )
    )
    assert s == r.choices[0].text


def test_chat_whole_and_streamed(server, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JAX?"}]
    kw = {
        "model": server.model,
        "messages": msgs,
        "max_completion_tokens": 20,
        "temperature": 0.8,
        "seed": 3,
        "logit_bias": NO_SPECIAL,
    }
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    prompt_ids = server.engine.tokenizer.apply_chat_template(msgs)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 20 and whole.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_bytes_never_split_characters(server, client):
    """Streamed text never shows '\ufffd' for a character split across tokens: it equals the bytes decoded whole."""
    for seed in range(3):
        chunks = list(
            client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "Caf\u00e9 \u6771\u4eac \U0001f600"}],
                max_tokens=40,
                temperature=1.0,
                seed=seed,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                logit_bias=NO_SPECIAL,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        raw = bytes(
            b
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
            for b in e.bytes
        )
        assert (
            sum(
                len(c.choices[0].logprobs.content)
                for c in chunks
                if c.choices and c.choices[0].logprobs
            )
            == 40
        )
        # a character cut by max_tokens leaves no U+FFFD at the end of the text (issue 18)
        assert text == raw.decode("utf-8", errors="replace").removesuffix("\ufffd")
        for c in chunks:
            if c.choices and c.choices[0].logprobs:
                for e in c.choices[0].logprobs.content:
                    assert (
                        len(e.top_logprobs) == 2
                        and e.top_logprobs[0].logprob >= e.logprob - 1e-4 - 50
                    )


def test_chat_n2_and_stop(server, client):
    kw = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Count"}],
        "temperature": 1.0,
        "seed": 11,
        "logit_bias": NO_SPECIAL,
    }
    r = client.chat.completions.create(n=2, max_tokens=12, logprobs=True, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices) == 24
    text = r.choices[1].message.content
    stop = text[4:6]
    assert stop.strip(), text
    r2 = client.chat.completions.create(n=2, max_tokens=12, stop=[stop], **kw)
    assert (
        r2.choices[1].finish_reason == "stop"
        and r2.choices[1].message.content == text[: text.index(stop)]
    )


def test_reset_prefix_cache(server, client, http):
    prompt = "The same long prompt, sent twice to warm the prefix cache. " * 4
    client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert server.on_engine(lambda e: e.scheduler.kv.cache.num_evictable) > 0
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["freed_blocks"] > 0
    assert server.on_engine(lambda e: e.scheduler.kv.cache.num_evictable) == 0
    server.on_engine(lambda e: e.scheduler.kv.check_invariants())


def test_tokenize_detokenize(server, http):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == server.engine.tokenizer.encode("Hello world") and r["count"] == len(
        r["tokens"]
    )
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    msgs = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == server.engine.tokenizer.apply_chat_template(msgs)
