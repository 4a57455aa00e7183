"""Anthropic's Messages API through a real server and the official `anthropic` client, on a tiny
random model with a tool-capable chat template. Answers are checked against the chat-completions
path they share (same prompt, same greedy text) and against the SDK's own types."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent

from tests.server.agent_models import AGENT_ENGINE, WEATHER, with_tool_template
from tests.server.conftest import ServerThread
from tests.server.sdk_types import aborted, exact, sse_events

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
SYSTEM = "You are terse."
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
# compiled on demand: the few buckets these requests meet, not all of them
ENGINE = {**AGENT_ENGINE, "max_num_seqs": 8}
# This SDK has no sampling arguments (newer models fix them); the server still reads them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    model = with_tool_template(tiny_model("llama", max_pos=2048), tmp_path_factory.mktemp("msgs"))
    s = ServerThread(model, ENGINE, precompile=False, tool_call_parser="hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)


def chat_twin(srv, max_tokens=8, **kw):
    """The same conversation through /v1/chat/completions, greedy."""
    return srv.client().chat.completions.create(
        model=srv.model, messages=[{"role": "system", "content": SYSTEM}, *USER],
        max_tokens=max_tokens, extra_body=GREEDY, **kw)


def test_text_answer_is_the_chat_paths_answer(srv, client):
    raw = client.messages.with_raw_response.create(
        model=srv.model, system=SYSTEM, messages=USER, max_tokens=8, extra_body=GREEDY)
    msg = exact(Message, raw.http_response.json())
    want = chat_twin(srv)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == want.choices[0].message.content
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == srv.model
    assert msg.usage.input_tokens == want.usage.prompt_tokens
    assert msg.usage.output_tokens == want.usage.completion_tokens
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        want.choices[0].finish_reason]


def test_stream_events_add_up_to_the_whole_answer(srv, client):
    whole = client.messages.create(model=srv.model, system=SYSTEM, messages=USER, max_tokens=8,
                                   extra_body=GREEDY)
    events = sse_events(srv, "/v1/messages", {"model": srv.model, "system": SYSTEM, "messages": USER,
                              "max_tokens": 8, "temperature": 0, "stream": True}, RawMessageStreamEvent)
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert events[-2]["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model=srv.model, system=SYSTEM, messages=USER, max_tokens=8,
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
        assert s.text_stream is not None
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason


def test_stop_sequence(srv, client):
    text = chat_twin(srv, max_tokens=12).choices[0].message.content
    stop = text[3:5]
    assert stop, text
    msg = client.messages.create(model=srv.model, system=SYSTEM, messages=USER, max_tokens=12,
                                 extra_body=GREEDY, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_tool_use_round_trip(srv, client, choice):
    first = client.messages.create(model=srv.model, messages=USER, tools=[TOOL],
                                   tool_choice=choice, max_tokens=400, extra_body=GREEDY)
    exact(Message, first.model_dump(mode="json", exclude_unset=True))
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, TOOL["input_schema"])
    history = [*USER, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id, "content": "12 C, sunny"},
                   {"type": "text", "text": "Thanks."}]}]
    second = client.messages.create(model=srv.model, messages=history, tools=[TOOL],
                                    tool_choice={"type": "none"}, max_tokens=4, extra_body=GREEDY)
    assert second.stop_reason in ("max_tokens", "end_turn")
    assert [b.type for b in second.content] == ["text"]
    # the call and its result reach the chat template as a chat request's tool_calls and tool turn
    twin = [*USER, {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 C, sunny"},
        {"role": "user", "content": "Thanks."}]
    ids = srv.app.state.serving.tok.apply_chat_template(twin, tools=[WEATHER],
                                                        add_generation_prompt=True)
    counted = client.messages.count_tokens(model=srv.model, messages=history, tools=[TOOL])
    assert counted.input_tokens == second.usage.input_tokens == len(ids)


def test_forced_tool_use_streams_its_input_piecewise(srv, client):
    with client.messages.stream(model=srv.model, messages=USER, tools=[TOOL], max_tokens=400,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as s:
        pieces = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    call = final.content[-1]
    assert final.stop_reason == "tool_use" and call.type == "tool_use"
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input
    jsonschema.validate(call.input, TOOL["input_schema"])


def test_count_tokens_is_the_rendered_prompt(srv, client):
    raw = client.messages.with_raw_response.count_tokens(model=srv.model, system=SYSTEM,
                                                         messages=USER)
    counted = exact(MessageTokensCount, raw.http_response.json())
    assert counted.input_tokens == chat_twin(srv, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize("body,field", [
    ({"messages": USER}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
      "max_tokens": 4}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "max_tokens": 4},
     "messages[0].content[0]"),
    ({"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled"}}, "thinking"),
    ({"messages": USER, "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "max_tokens": 4, "temperature": 7.0}, "temperature"),
    ({"messages": USER, "max_tokens": 4, "tools": [TOOL], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ({"messages": USER, "max_tokens": 4, "tools": [{**TOOL, "type": "web_search_20250305"}]},
     "tools[0].type"),
    ({"messages": USER, "max_tokens": 5000}, "max_tokens"),
    ({"messages": USER, "max_tokens": 4, "tools": [{**TOOL, "name": "bad name"}]},
     "tools[0].name"),
    ({"messages": USER, "max_tokens": 4, "stop_sequences": "x"}, "stop_sequences"),
])
def test_bad_requests_are_one_400_naming_the_field(srv, body, field):
    with srv.http() as h:
        r = h.post("/v1/messages", json={"model": srv.model, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"], err
    srv.wait_idle()


def test_errors_reach_the_sdk_in_anthropics_shape(srv, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", messages=USER, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=srv.model, messages=USER, max_tokens=4,
                               extra_body={"top_k": "x"})
    assert "top_k" in e.value.body["error"]["message"]


def test_x_api_key_is_the_key(tiny_model, tmp_path_factory):
    model = with_tool_template(tiny_model("llama", max_pos=2048), tmp_path_factory.mktemp("key"))
    s = ServerThread(model, ENGINE, precompile=False, api_key="sekrit")
    try:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0)
        assert ok.messages.count_tokens(model=s.model, messages=USER).input_tokens > 0
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.count_tokens(model=s.model, messages=USER)
        assert e.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": "Invalid API key."}}
    finally:
        s.stop()


def test_thinking_blocks_where_a_reasoning_parser_is_set(srv, client, monkeypatch):
    """deepseek_r1: the template opened the thinking, so an answer that never closes it (the random
    model's) is all thinking."""
    monkeypatch.setattr(srv.app.state.serving.cfg, "reasoning_parser", "deepseek_r1")
    whole = client.messages.create(model=srv.model, messages=USER, max_tokens=6,
                                   extra_body=GREEDY)
    assert [b.type for b in whole.content] == ["thinking"]
    with client.messages.stream(model=srv.model, messages=USER, max_tokens=6,
                                extra_body=GREEDY) as s:
        thinking = "".join(e.thinking for e in s if e.type == "thinking")
        final = s.get_final_message()
    assert thinking == whole.content[0].thinking == final.content[0].thinking


def test_a_client_that_leaves_mid_stream_frees_its_request(srv):
    before = aborted(srv)
    with srv.http() as h, h.stream("POST", "/v1/messages", json={
            "model": srv.model, "messages": USER, "max_tokens": 1500, "stream": True}) as r:
        next(r.iter_lines())  # message_start: the request is running
    assert srv.wait_idle()["num_running"] == 0
    assert aborted(srv) == before + 1
