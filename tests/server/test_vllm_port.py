"""vLLM's own OpenAI-server tests (tests/entrypoints/openai/), ported to this server.

Each test names the vLLM test it ports (basic/test_basic.py, completion/test_completion.py,
completion/test_prompt_validation.py, chat_completion/test_chat.py,
embedding_tests/test_optional_middleware.py). They run against a real uvicorn server over a tiny
random-init Llama, through the official `openai` client. vLLM's shutdown tests
(completion/test_shutdown.py) are ported in test_shutdown.py and test_limits.py:
test_wait_timeout_completes_requests and test_request_rejection_during_shutdown ->
test_serve_cli_sigterm_drains; test_abort_timeout_fails_inflight_requests ->
test_shutdown_timeout_aborts_with_abort_chunks_and_503; the drain's 503 ->
test_drain_refuses_new_work_and_aborts_at_timeout. basic's test_server_load -> test_endpoints.py's
test_load_counts_generate_calls_in_flight; completion's truncation-side test ->
test_truncate_prompt_tokens.

Expected to be a 400 (never a silent 200): use_beam_search, min_characters. Structured outputs
(structured_outputs json / regex / choice, response_format json_object / json_schema) are obeyed once
the engine applies grammars, a 400 until then.
The structured-output, tool and reasoning cases are tested in test_structured.py and test_tools.py.

Not applicable, and why:
- LoRA adapters (zephyr-lora), prompt embeddings, multimodal (vision, audio, video), embeddings,
  scoring, transcription, harmony: features this server does not have; their fields are refused
  with a 400 naming them (see test_errors.py).
- Assertions on a real model's text ("content == '2'", JSON answers, distinct lengths because some
  samples stop at EOS early, exact prompt token counts of opt-125m/zephyr): a random-weight model
  writes noise and rarely meets EOS; the shapes, counts and invariants are asserted instead.
- `--disable-frontend-multiprocessing` variants: there is one process; the engine runs on a thread.
- test_health_check_engine_dead_error mocks vLLM's engine client; test_health.py kills a real
  engine loop instead.
- Exact pydantic wording ("greater_than_equal" for a seed out of range): we answer a 400 naming
  `seed` with our own message; the message of the empty-prompt case differs the same way.
- `usage == CompletionUsage(...)` equality: we always send `prompt_tokens_details` (as OpenAI
  does), which vLLM sends only with --enable-prompt-tokens-details; the counts are compared.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest

import jaxserve
from tests.server.agent_models import ENGINE_SUPPORTS_STRUCTURED
from tests.server.conftest import ServerThread

MSGS = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


# ---- basic/test_basic.py ---------------------------------------------------------------------------
def test_show_version_and_health(server, http):
    assert http.get("/version").json() == {"version": jaxserve.__version__}
    assert http.get("/health").status_code == 200


def test_request_cancellation(server):
    """200 chat requests that time out client-side are all aborted; the server answers next."""

    async def run() -> None:
        # vLLM uses 0.5 s with a real model; the tiny random model can finish 200 tokens in under
        # 0.5 s once the others are aborted, so the client gives up sooner here.
        client = server.async_client(timeout=0.1)
        tasks = [
            asyncio.create_task(
                client.chat.completions.create(
                    messages=[{"role": "user", "content": "Write a long story"}],
                    model=server.model,
                    max_tokens=200,
                    extra_body={"min_tokens": 200},
                )
            )
            for _ in range(200)
        ]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)
        assert not pending
        for d in done:
            with pytest.raises(openai.APITimeoutError):
                d.result()
        await client.close()

    asyncio.run(run())
    assert server.wait_idle()["blocks_used"] == 0  # every timed-out request was aborted
    r = server.client(timeout=30).chat.completions.create(
        messages=[{"role": "user", "content": "Write a long story"}],
        model=server.model,
        max_tokens=10,
    )
    assert len(r.choices) == 1


def test_request_wrong_content_type(server, client):
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(
            messages=MSGS,
            model=server.model,
            max_tokens=10,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
        )


# ---- completion/test_completion.py ----------------------------------------------------------------
def test_single_completion(server, client):
    tok = server.engine.tokenizer
    prompt = "Hello, my name is (single completion)"
    c = client.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0)
    assert c.id is not None and len(c.choices) == 1
    assert c.choices[0].finish_reason in ("length", "stop")
    assert (
        c.usage.completion_tokens == 5
        if c.choices[0].finish_reason == "length"
        else 1 <= (c.usage.completion_tokens) < 5
    )
    assert c.usage.prompt_tokens == len(tok.encode(prompt))
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.usage.prompt_tokens_details.cached_tokens == 0  # a prompt not seen before
    c = client.completions.create(
        model=server.model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0
    )
    assert getattr(c.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize("n,lo,hi", [(None, None, None), (0, 1, 1), (5, 5, 6)])
def test_completion_logprobs_counts(server, client, n, lo, hi):
    c = client.completions.create(
        model=server.model, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0, logprobs=n
    )
    lp = c.choices[0].logprobs
    if n is None:
        assert lp is None
        return
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lo <= len(lp.top_logprobs[0]) <= hi


def test_too_many_completion_logprobs(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=[0] * 5, max_tokens=5, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in client.completions.create(
            model=server.model, prompt=[0] * 5, max_tokens=5, logprobs=30, stream=True
        ):
            pass
    assert client.completions.create(model=server.model, prompt=[0] * 5, max_tokens=5).choices


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, 5, None])
def test_prompt_logprobs_completion(server, client, prompt_logprobs):
    kw = {"prompt": ["A robot may not injure another robot", "My name is"], "model": server.model}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.body["param"] == "prompt_logprobs"
        return
    c = client.completions.create(**kw)
    for choice in c.choices:
        rows = (choice.model_extra or {}).get("prompt_logprobs")
        if prompt_logprobs is None:
            assert rows is None
        else:
            assert rows and rows[0] is None and len(rows) > 1


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_chat(server, client, prompt_logprobs):
    msgs = [*MSGS, {"role": "assistant", "content": "2"}, {"role": "user", "content": "Sure?"}]
    kw = {"model": server.model, "max_tokens": 5, "messages": msgs}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**kw)
        return
    r = client.chat.completions.create(**kw)
    rows = (r.model_extra or {}).get("prompt_logprobs")
    if prompt_logprobs is None:
        assert rows is None
    else:
        assert rows and rows[0] is None and len(rows) > 1


def test_completion_streaming(server, client):
    kw = {"model": server.model, "prompt": "What is an LLM?", "max_tokens": 5, "temperature": 0}
    single = client.completions.create(**kw).choices[0].text
    chunks, finishes = [], 0
    for chunk in client.completions.create(stream=True, **kw):
        chunks.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length"
    assert "".join(chunks) == single


def test_parallel_no_streaming(server, client):
    n, max_tokens = 3, 50
    c = client.completions.create(
        model=server.model,
        prompt="What is an LLM?",
        max_tokens=max_tokens,
        n=n,
        temperature=1.0,
        logprobs=0,
        seed=42,
    )
    assert len(c.choices) == n
    for i, choice in enumerate(c.choices):
        assert choice.index == i and choice.finish_reason is not None
        assert len(choice.logprobs.tokens) <= max_tokens
    assert len({ch.text for ch in c.choices}) == n


def test_parallel_streaming(server, client):
    n, max_tokens = 3, 50
    chunks = [[] for _ in range(n)]
    finishes = 0
    for chunk in client.completions.create(
        model=server.model,
        prompt="What is an LLM?",
        max_tokens=max_tokens,
        n=n,
        temperature=1.0,
        stream=True,
        seed=42,
    ):
        chunks[chunk.choices[0].index].append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == n
    assert all(len(c) <= max_tokens for c in chunks)
    assert len({"".join(c) for c in chunks}) == n


@pytest.mark.parametrize("chat", [False, True])
def test_stream_options(server, client, chat):
    def create(**kw):
        base = {"model": server.model, "max_tokens": 5, "temperature": 0.0, **kw}
        if chat:
            return client.chat.completions.create(messages=MSGS, **base)
        return client.completions.create(prompt="What is the capital of France?", **base)

    for opts in (
        {"include_usage": False, "continuous_usage_stats": False},
        {"include_usage": False, "continuous_usage_stats": True},
        {},
    ):
        assert all(ch.usage is None for ch in create(stream=True, stream_options=opts))
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage.prompt_tokens > 0
    assert final.usage.completion_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    chunks = list(
        create(
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"min_tokens": 5},
        )
    )
    last = 0
    for ch in chunks:
        assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
        assert ch.usage.completion_tokens >= last
        last = ch.usage.completion_tokens
    assert last == 5
    for opts in (
        {"include_usage": None},
        {"include_usage": True},
        {"continuous_usage_stats": None},
        {"continuous_usage_stats": True},
    ):
        with pytest.raises(openai.BadRequestError):
            create(stream=False, stream_options=opts)


def test_batch_completions(server, client):
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        kw = {"model": server.model, "prompt": prompts, "max_tokens": 5, "temperature": 0.0}
        batch = client.completions.create(**kw)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        with pytest.raises(openai.BadRequestError) as e:  # beam search: not implemented
            client.completions.create(n=2, extra_body={"use_beam_search": True}, **kw)
        assert e.value.body["param"] == "use_beam_search"
        texts = ["", ""]
        for chunk in client.completions.create(stream=True, **kw):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs", [1, 0])
def test_echo_logprob_completion(server, client, logprobs):
    """vLLM's test: echo with logprobs returns the prompt's logprobs first (the first None)."""
    tok = server.engine.tokenizer
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
            logprobs=logprobs,
        )
        prompt_text = tok.decode(prompt) if isinstance(prompt, list) else prompt
        assert completion.choices[0].text.startswith(prompt_text)
        lp = completion.choices[0].logprobs
        assert lp is not None
        assert len(lp.text_offset) > 5
        assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            assert max(logprobs, 1) <= len(top) <= logprobs + 1
        assert len(lp.tokens) > 5


@pytest.mark.parametrize(
    "structured",
    [
        {"json": {"type": "object", "properties": {"foo": "bar"}}},
        {"regex": r"[.*"},
        {"grammar": "root ::= select_statementinvalidsyntax"},
    ],
    ids=["invalid-json-schema", "invalid-regex", "invalid-grammar"],
)
def test_invalid_structured_outputs(server, client, structured):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=server.model, prompt="Generate", extra_body={"structured_outputs": structured}
        )


# ---- completion/test_prompt_validation.py ---------------------------------------------------------
def test_empty_prompt(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=server.model,
            prompt=None,
            max_tokens=5,
            temperature=0.0,
            extra_body={"prompt_embeds": []},
        )


def test_out_of_vocab_token_ids(server, client):
    with pytest.raises(openai.BadRequestError, match=".*out of vocabulary.*"):
        client.completions.create(
            model=server.model, prompt=[999999], max_tokens=5, temperature=0.0
        )


# ---- chat_completion/test_chat.py -----------------------------------------------------------------
@pytest.mark.parametrize("top,expect", [(None, None), (0, 0), (5, 5)])
def test_chat_logprobs(server, client, top, expect):
    c = client.chat.completions.create(
        model=server.model,
        messages=MSGS,
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=top is not None,
        **({"top_logprobs": top} if top is not None else {}),
    )
    lp = c.choices[0].logprobs
    if expect is None:
        assert lp is None
    else:
        assert lp.content is not None and len(lp.content[0].top_logprobs) == expect
        assert all(item.logprob >= -9999.0 for item in lp.content[0].top_logprobs)


def test_too_many_chat_logprobs(server, client):
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in client.chat.completions.create(
            model=server.model,
            messages=MSGS,
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=21,
            stream=True,
        ):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model,
            messages=MSGS,
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=30,
        )
    c = client.chat.completions.create(model=server.model, messages=MSGS, max_completion_tokens=10)
    assert c.choices[0].message.content is not None


def test_single_chat_session(server, client):
    messages = list(MSGS)
    c = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    assert c.id is not None and len(c.choices) == 1
    choice = c.choices[0]
    assert choice.finish_reason == "length"
    assert c.usage.completion_tokens == 5
    assert c.usage.prompt_tokens == len(server.engine.tokenizer.apply_chat_template(messages))
    assert c.usage.total_tokens == c.usage.prompt_tokens + 5
    assert choice.message.role == "assistant" and choice.message.content is not None
    messages += [
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "express your result in json"},
    ]
    c = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=5
    )
    assert c.choices[0].message.content is not None


def test_chat_streaming(server, client):
    kw = {"model": server.model, "messages": MSGS, "max_completion_tokens": 10, "temperature": 0.0}
    whole = client.chat.completions.create(**kw).choices[0]
    chunks, finishes = [], 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == whole.finish_reason
    assert "".join(chunks) == whole.message.content


@pytest.mark.parametrize(
    "extra,check",
    [
        ({"structured_outputs": {"choice": ["Python", "Rust"]}}, lambda t: t in ("Python", "Rust")),
        ({"structured_outputs": {"regex": "a+"}}, lambda t: re.fullmatch("a+", t)),
        ({"structured_outputs": {"json": {"type": "object"}}}, lambda t: t.startswith("{")),
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "foo", "schema": {"type": "object"}}}}, lambda t: t.startswith("{")),
    ],
    ids=["choice", "regex", "json", "json_object", "json_schema"],
)
def test_structured_outputs_chat(server, client, extra, check):
    """Obeyed once the engine applies grammars; until then a 400 naming the field, never a
    silent unconstrained 200."""
    kw = {"model": server.model, "messages": MSGS, "max_completion_tokens": 10, "extra_body": extra}
    if not ENGINE_SUPPORTS_STRUCTURED:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw)
        assert e.value.body["param"].split(".")[0] == next(iter(extra))
        return
    c = client.chat.completions.create(**kw)
    assert check(c.choices[0].message.content), c.choices[0].message.content


def test_min_characters_refused(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model, messages=MSGS, max_completion_tokens=10,
            extra_body={"min_characters": 10},
        )
    assert e.value.body["param"] == "min_characters"


def test_response_format_text(server, client):
    c = client.chat.completions.create(
        model=server.model,
        messages=MSGS,
        max_completion_tokens=10,
        response_format={"type": "text"},
    )
    assert c.choices[0].message.content is not None


def test_extra_fields_allowed(server, client):
    c = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
        temperature=0,
        seed=0,
        max_tokens=5,
    )
    assert c.choices[0].message.content is not None


def test_custom_role(server, client):
    kw = {"model": server.model, "temperature": 0, "seed": 0, "max_tokens": 8}
    a = client.chat.completions.create(
        messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], **kw
    )
    b = client.chat.completions.create(
        messages=[
            {"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}
        ],
        **kw,
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_long_seed(server, client):
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=server.model, messages=MSGS, temperature=0, seed=seed
            )
        assert e.value.body["param"] == "seed"


def test_invocations(server, client, http):
    args = {
        "model": server.model,
        "messages": MSGS,
        "max_completion_tokens": 5,
        "temperature": 0.0,
        "logprobs": False,
    }
    chat = client.chat.completions.create(**args).model_dump(exclude_none=True)
    inv = http.post("/invocations", json=args)
    inv.raise_for_status()
    out = inv.json()
    assert set(chat) <= set(out)
    assert [c["message"] for c in chat["choices"]] == [c["message"] for c in out["choices"]]


def test_chat_n(server, client):
    c = client.chat.completions.create(
        model=server.model, messages=MSGS, max_completion_tokens=20, temperature=0.7, n=3
    )
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert all(ch.message.content is not None for ch in c.choices)
    assert len({ch.message.content for ch in c.choices}) > 1
    by_index = defaultdict(list)
    for chunk in client.chat.completions.create(
        model=server.model,
        messages=MSGS,
        max_completion_tokens=15,
        temperature=0.7,
        n=2,
        stream=True,
        logit_bias={"0": -100, "1": -100, "2": -100},
    ):
        for choice in chunk.choices:
            if choice.delta.content:
                by_index[choice.index].append(choice.delta.content)
    assert by_index[0] and by_index[1]
    c = client.chat.completions.create(
        model=server.model, messages=MSGS, max_completion_tokens=10, temperature=0.8, n=2, seed=42
    )
    assert [ch.index for ch in c.choices] == [0, 1]


# ---- embedding_tests/test_optional_middleware.py --------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    s = ServerThread(tiny_llama, api_key="test", enable_request_id_headers=True,
                     profiler_dir=str(tmp_path_factory.mktemp("profile")))
    yield s
    s.stop()


def test_no_api_token_and_no_request_id_by_default(server, http):
    assert http.get("/v1/models").status_code == 200
    assert "X-Request-Id" not in http.get("/health").headers


def test_api_token(keyed):
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer test"})
    assert r.status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # public path
    assert httpx.get(keyed.url + "/ping").status_code == 200  # SageMaker's, also public
    assert httpx.post(keyed.url + "/invocations", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401


def test_profile_routes_write_a_jax_trace(keyed):
    """vLLM's /start_profile and /stop_profile (admin: the key always), here over jax's profiler."""
    auth = {"Authorization": "Bearer test"}
    assert httpx.post(keyed.url + "/start_profile").status_code == 401
    assert httpx.post(keyed.url + "/start_profile", headers=auth).json() == {"status": "started"}
    again = httpx.post(keyed.url + "/start_profile", headers=auth)
    assert again.status_code == 400 and "/stop_profile" in again.json()["error"]["message"]
    r = httpx.post(keyed.url + "/v1/completions", headers=auth, json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    assert httpx.post(keyed.url + "/stop_profile", headers=auth).json() == {"status": "stopped"}
    traces = list(Path(keyed.cfg.profiler_dir).glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    again = httpx.post(keyed.url + "/stop_profile", headers=auth)
    assert again.status_code == 400 and "/start_profile" in again.json()["error"]["message"]


def test_profile_routes_off_by_default(server, http):
    r = http.post("/start_profile")
    assert r.status_code == 400 and "--profiler-dir" in r.json()["error"]["message"]


def test_profiler_dir_must_be_writable(tmp_path):
    from jaxserve.errors import UserError
    from jaxserve.server.config import ServerConfig

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="Not a directory"):
        ServerConfig(profiler_dir=str(tmp_path / "file" / "traces"))


def test_request_id_header(keyed):
    r = httpx.get(keyed.url + "/health")
    assert len(r.headers["X-Request-Id"]) == 32
    r = httpx.get(keyed.url + "/health", headers={"X-Request-Id": "Custom"})
    assert r.headers["X-Request-Id"] == "Custom"
    r = httpx.post(
        keyed.url + "/v1/completions",
        headers={"Authorization": "Bearer test", "X-Request-Id": "abc-1"},
        json={"prompt": "Hi", "max_tokens": 2, "stream": True},
    )
    assert r.headers["X-Request-Id"] == "abc-1" and r.text.endswith("data: [DONE]\n\n")
    assert json.loads(r.text.split("\n\n")[0][6:])["object"] == "text_completion"
