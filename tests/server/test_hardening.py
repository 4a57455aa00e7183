"""No request can stall the server or reach what it should not (issue 18, security/availability).

Two real servers: the shared default one (no key, no trusted templates) and `strict`: an API key,
CORS for one origin, request-id headers, trusted request templates with a 1 s render bound, and a
cap of 8 sequences per request.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerThread

KEY = "s3cret"
ORIGIN = "https://app.example"
MSG = [{"role": "user", "content": "Hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
# 10^10 empty iterations: hours of Jinja, unless the render bound stops it.
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)


@pytest.fixture(scope="module")
def strict(tiny_llama):
    s = ServerThread(
        tiny_llama,
        api_key=KEY,
        allowed_origins=(ORIGIN,),
        enable_request_id_headers=True,
        trust_request_chat_template=True,
        render_timeout=1.0,
        max_seqs_per_request=8,
    )
    yield s
    s.stop()


def authed(s: ServerThread) -> httpx.Client:
    return s.http(headers={"Authorization": f"Bearer {KEY}"})


def test_request_template_refused_by_default(server, http):
    for body, param in [
        ({"chat_template": "{{ 'x' }}"}, "chat_template"),
        (
            {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
            "chat_template_kwargs.chat_template",
        ),
    ]:
        r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "--trust-request-chat-template" in err["message"]
    r = http.post("/tokenize", json={"messages": MSG, "chat_template": "{{ 'x' }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "add_generation_prompt", "tools"])
def test_server_owned_template_kwargs_are_400(server, http, key):
    r = http.post(
        CHAT, json={"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {key: False}}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"


def test_template_variables_pass_through(server, http):
    r = http.post(
        CHAT,
        json={"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.status_code == 200, r.text


def test_trusted_template_is_used(strict):
    with authed(strict) as h:
        r = h.post(
            "/tokenize", json={"messages": MSG, "chat_template": "[{{ messages[0]['content'] }}]"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == strict.engine.tokenizer.encode(
            "[Hi]", add_special_tokens=False
        )


def test_pathological_template_ends_in_400_while_health_answers(strict):
    """The render runs off the event loop, is stopped at its bound, and /health never waits."""
    answered, latencies, stop = [], [], threading.Event()

    def poll_health() -> None:
        with strict.http() as h:
            while not stop.is_set():
                t0 = time.perf_counter()
                answered.append(h.get("/health").status_code)
                latencies.append(time.perf_counter() - t0)

    with authed(strict) as h:
        poller = threading.Thread(target=poll_health)
        poller.start()
        try:
            r = h.post(
                CHAT, json={"messages": MSG, "max_tokens": 2, "chat_template": SLOW_TEMPLATE}
            )
        finally:
            stop.set()
            poller.join(30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "timeout" and "1 s" in r.json()["error"]["message"]
        # /health kept answering during the render: many answers, all OK
        assert len(answered) >= 5 and set(answered) == {200}, answered
        print(
            f"/health during the render: {len(latencies)} answers, "
            f"max {max(latencies) * 1000:.1f} ms"
        )
        # the render thread was stopped, not left spinning
        deadline = time.monotonic() + 10
        while any(t.name == "jaxserve-offload" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the timed-out render is still running"
            time.sleep(0.05)
        ok = h.post(CHAT, json={"messages": MSG, "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    "headers,content",
    [
        ({"content-type": "application/x-www-form-urlencoded"}, b"prompt=Hello&max_tokens=2"),
        ({}, b'{"prompt": "Hello", "max_tokens": 2}'),
        ({"content-type": "text/plain"}, b'{"prompt": "Hello", "max_tokens": 2}'),
    ],
    ids=["form", "missing", "text-plain"],
)
def test_wrong_content_type_is_415(server, http, headers, content):
    r = http.post(C, content=content, headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]


def test_json_with_charset_is_accepted(server, http):
    r = http.post(
        C,
        content=b'{"prompt": "Hello", "max_tokens": 2}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


def test_huge_prompt_refused_before_tokenizing(server, http):
    """A 7 MiB prompt is a 400 by its length in characters, decided before any tokenizing."""
    big = "word " * ((7 << 20) // 5)  # 7 MiB
    for path, body in [
        (C, {"prompt": big, "max_tokens": 2}),
        (CHAT, {"messages": [{"role": "user", "content": big}], "max_tokens": 2}),
        ("/tokenize", {"prompt": big}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["code"] == "context_length_exceeded" and f"{len(big)} characters" in err["message"]
        )


def test_sequences_per_request_capped(strict):
    with authed(strict) as h:
        r = h.post(C, json={"prompt": ["a"] * 5, "n": 2, "max_tokens": 2, "temperature": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
        assert r.json()["error"]["param"] == "n"
        r = h.post(C, json={"prompt": ["a"] * 4, "n": 2, "max_tokens": 2, "temperature": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_never_fits_kv_cache_is_400_not_429(tiny_llama):
    """A request longer than the whole KV cache could never run: 400, not 'retry later'."""
    s = ServerThread(tiny_llama, engine_kw={"num_blocks": 8}, precompile=False)  # 7 usable blocks = 112 tokens
    try:
        with s.http() as h:
            r = h.post(C, json={"prompt": "Hello", "max_tokens": 200})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "max_tokens"
            assert "KV cache" in r.json()["error"]["message"]
            assert h.post(C, json={"prompt": "Hello", "max_tokens": 8}).status_code == 200
    finally:
        s.stop()


def test_admin_routes_need_the_key(strict):
    with strict.http() as h:
        assert h.post("/reset_prefix_cache").status_code == 401
    with authed(strict) as h:
        assert h.post("/reset_prefix_cache").status_code == 200
    from jaxserve.errors import UserError
    from jaxserve.server.config import ServerConfig

    with pytest.raises(UserError, match="admin route"):
        ServerConfig(api_key=KEY, public_paths=("/health", "/reset_prefix_cache"))


def test_models_show_no_local_path(server, http, tiny_llama):
    body = http.get("/v1/models").text
    assert str(tiny_llama) not in body
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == os.path.basename(tiny_llama)
    # the --model argument itself is still accepted as the model name (vLLM's default name)
    r = http.post(C, json={"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == str(tiny_llama)


def test_cors_preflight_passes_the_key_check(strict):
    with strict.http() as h:
        r = h.options(
            CHAT,
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        r = h.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401  # the real request still needs the key
        assert r.headers["access-control-allow-origin"] == ORIGIN
        r = h.options(
            CHAT,
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in r.headers


def test_no_cors_headers_by_default(server, http):
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers
