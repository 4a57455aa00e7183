"""Issue 31: no request can kill or stall the server. Each hostile input is a 400 naming its
field, a request's own failure is that request's, and the server serves on (/health 200, no
KV block held)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from jaxserve.server.http_protocol import HeaderTimeoutProtocol

MSG = [{"role": "user", "content": "Hi"}]


def assert_serving(server, http) -> None:
    assert http.get("/health").status_code == 200
    stats = server.wait_idle()
    assert stats["num_running"] == 0
    server.on_engine(lambda e: e.scheduler.kv.check_invariants())
    kv = server.on_engine(lambda e: (e.scheduler.kv.num_available_blocks, e.scheduler.kv.num_blocks))
    assert kv[0] == kv[1] - 1, f"KV blocks still held: {kv}"  # all free or evictable (null block aside)
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def bad(http, path: str, body: dict, param: str) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def deep(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_deep_json_schema_string_is_400(server, http, field):
    schema = deep(5000)
    value = schema if field == "guided_json" else {"json": schema}
    param = "guided_json" if field == "guided_json" else "structured_outputs.json"
    bad(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value}, param)


def test_deep_tool_call_arguments_are_400_and_empty_arguments_pass(server, http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(5000)}}
    msgs = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    bad(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2},
        "messages[1].tool_calls[0].function.arguments")
    call["function"]["arguments"] = ""  # vLLM accepts a call without arguments
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["²", "1" * 5000, "١"])
def test_logit_bias_odd_keys_are_400(server, http, key):
    bad(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {key: 1}}, "logit_bias")


def test_invocations_deep_body_is_400(server, http):
    body = '{"prompt": "x", "max_tokens": 2, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = http.post("/invocations", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text


def test_deep_lark_grammar_is_400_and_server_lives(server, http):
    chain = "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(5000)] + ['r5000: "b"'])
    err = bad(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": chain},
              "guided_grammar")
    assert "rules" in err["message"]
    assert_serving(server, http)


def test_tool_defs_with_required_and_closed_objects(server, client):
    params = {"type": "object", "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
              "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"$ref": "#/$defs/Unit"}},
              "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        r = client.chat.completions.create(model=server.model, messages=MSG, tools=tools, tool_choice=choice,
                                           max_tokens=60, temperature=0)
        calls = r.choices[0].message.tool_calls
        if r.choices[0].finish_reason == "tool_calls":
            args = json.loads(calls[0].function.arguments)
            assert set(args) <= {"city", "unit"}  # closed: no undeclared property


@pytest.mark.parametrize("body,param", [
    ({"logprob_token_ids": [1, 2]}, "logprob_token_ids"),  # without logprobs: true
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
])
def test_vllm_refusals_on_chat(server, http, body, param):
    bad(http, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, **body}, param)


def test_truncation_bounds_tokenizing(server, http):
    bad(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "truncate_prompt_tokens": 10_000},
        "truncate_prompt_tokens")
    text = "hello world " * 200_000  # far past the char pre-check: only the kept end is tokenized
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20


def test_prompt_logprobs_sent_once_per_prompt(server, http):
    r = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2, "n": 3,
                                           "temperature": 1.0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert choices[0]["prompt_logprobs"] and all(c["prompt_logprobs"] is None for c in choices[1:])


def test_request_failure_is_that_requests_alone(server, http):
    """A fault traced to one request (here: building its row) aborts it with an error; a request
    beside it finishes, /health stays 200, and no block is held."""
    def arm(e):
        orig = e.planner.sampling

        def sampling(p, seq, ahead=()):
            if p.seed == 4242:
                raise RuntimeError("injected fault")
            return orig(p, seq, ahead)
        e.planner.sampling = sampling
    server.on_engine(arm)
    try:
        results = {}

        def send(seed):
            results[seed] = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "seed": seed})

        threads = [threading.Thread(target=send, args=(s,)) for s in (4242, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results[1].status_code == 200, results[1].text
        assert results[4242].status_code == 500
        assert results[4242].json()["error"]["code"] == "request_failed"
        assert "injected fault" in results[4242].json()["error"]["message"]
        with http.stream("POST", "/v1/completions",
                         json={"prompt": "hi", "max_tokens": 4, "seed": 4242, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert "request_failed" in lines[-2] and lines[-1] == "data: [DONE]"
    finally:
        server.on_engine(lambda e: e.planner.__dict__.pop("sampling", None))
    assert_serving(server, http)


def test_socket_stopped_mid_headers_is_closed(server, monkeypatch):
    monkeypatch.setattr(HeaderTimeoutProtocol, "header_timeout", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # closed by the server: recv returns b""
            if s.recv(1024) == b"":
                break
        else:
            pytest.fail("the server kept a half-sent request open")


def test_unknown_engine_state_exits_nonzero(tiny_llama, monkeypatch):
    """A fault that leaves the engine's state unknown (the device step itself raising, traced to
    no request) turns /health to 503, then the server exits with code 70 so a supervisor
    restarts it. The server is the CLI's (_Server), run in a thread."""
    import httpx
    import uvicorn

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.server import app as app_mod
    from tests.server.conftest import ENGINE, free_port

    monkeypatch.setattr(app_mod, "FATAL_GRACE_S", 1.0)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), **ENGINE))

    def broken_execute(batch, key):
        raise RuntimeError("injected device fault")

    engine.runner.execute = broken_execute
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = app_mod.build_app(engine)
    server = app_mod._Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                             app, url, engine.kv_capacity_tokens)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.get("/health").status_code == 200
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert h.get("/health").status_code == 503
    thread.join(60)
    assert not thread.is_alive() and server.exit_code == app_mod.FATAL_EXIT_CODE
