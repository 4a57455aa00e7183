"""OpenAI's Responses API through a real server and the official `openai` client
(`client.responses`), on a tiny random model with a tool-capable chat template. Answers are checked
against the chat-completions path they share and against the SDK's own types."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from jaxserve.server.responses_input import ResponseStore
from tests.server.agent_models import AGENT_ENGINE, WEATHER, with_tool_template
from tests.server.conftest import ServerThread
from tests.server.schemas import SCHEMAS
from tests.server.sdk_types import aborted, exact, sse_events

TOOL = {"type": "function", **WEATHER["function"]}
SYSTEM = "You are terse."
QUESTION = "What is the weather in Oslo?"
ENGINE = {**AGENT_ENGINE, "max_num_seqs": 8}  # compiled on demand: the buckets these requests meet
STORE_SIZE = 3


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    model = with_tool_template(tiny_model("llama", max_pos=2048), tmp_path_factory.mktemp("resp"))
    s = ServerThread(model, ENGINE, precompile=False, tool_call_parser="hermes",
                     responses_store_size=STORE_SIZE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


def create(srv, client, **kw) -> Response:
    """responses.create, its raw body checked against the SDK's Response type."""
    raw = client.responses.with_raw_response.create(model=srv.model, **kw)
    exact(Response, raw.http_response.json())
    return raw.parse()



def responses_events(srv, body: dict) -> list[dict]:
    """The raw stream, each event checked against the SDK's event types and numbered in order."""
    events = sse_events(srv, "/v1/responses", body, ResponseStreamEvent)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events

def test_text_answer_is_the_chat_paths_answer(srv, client):
    r = create(srv, client, instructions=SYSTEM, input=QUESTION, max_output_tokens=8,
               temperature=0)
    want = client.chat.completions.create(
        model=srv.model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert r.id.startswith("resp_") and r.model == srv.model
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == want.choices[0].message.content
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    if want.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_stream_events_add_up_to_the_whole_answer(srv, client):
    kw = {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = create(srv, client, **kw)
    events = responses_events(srv, {"model": srv.model, "stream": True, **kw})
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]
    usage = Response.model_validate(events[-1]["response"]).usage
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens,
                                                         whole.usage.output_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call(srv, client, stream):
    kw = {"input": QUESTION, "tools": [TOOL], "max_output_tokens": 400, "temperature": 0,
          "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        events = responses_events(srv, {"model": srv.model, "stream": True, **kw})
        pieces = [e["delta"] for e in events
                  if e["type"] == "response.function_call_arguments.delta"]
        r = Response.model_validate(events[-1]["response"])
        assert "".join(pieces) == r.output[-1].arguments and len(pieces) > 1
        # the SDK's own stream helper rebuilds the same response from the events
        with client.responses.stream(model=srv.model, **kw) as s:
            final = s.get_final_response()
        assert final.output[-1].arguments == r.output[-1].arguments
    else:
        r = create(srv, client, **kw)
    call = r.output[-1]
    assert r.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"


def test_text_format_json_schema(srv, client):
    schema = SCHEMAS["nested"]
    r = create(srv, client, input="Who?", max_output_tokens=200, temperature=0,
               text={"format": {"type": "json_schema", "name": "who", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "who"


def test_two_turns_by_previous_response_id(srv, client):
    tok = srv.app.state.serving.tok
    first = create(srv, client, input="Hi", max_output_tokens=6, temperature=0)
    second = create(srv, client, input="And Oslo?", previous_response_id=first.id,
                    max_output_tokens=4, temperature=0)
    convo = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And Oslo?"}]
    assert second.previous_response_id == first.id
    # the same conversation sent whole, the first answer's output items included
    resent = create(srv, client, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Hi"}, *first.output, {"role": "user", "content": "And Oslo?"}])
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.output_text == second.output_text
    assert second.usage.input_tokens == len(tok.apply_chat_template(
        convo, add_generation_prompt=True))
    # a forced call, then its output as the next turn's input
    call = create(srv, client, input=QUESTION, tools=[TOOL], max_output_tokens=400,
                  tool_choice="required", temperature=0, parallel_tool_calls=False).output[-1]
    assert call.type == "function_call"
    # the stored response comes back as it was answered; deleted, it is gone
    assert client.responses.retrieve(second.id) == second
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_function_call_output_continues_the_conversation(srv, client):
    r = create(srv, client, input=QUESTION, tools=[TOOL], max_output_tokens=400,
               tool_choice="required", temperature=0, parallel_tool_calls=False)
    call = r.output[-1]
    nxt = create(srv, client, previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                 max_output_tokens=4, temperature=0,
                 input=[{"type": "function_call_output", "call_id": call.call_id,
                         "output": "12 C"}])
    convo = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "", "tool_calls": [{
                 "id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "12 C"}]
    tok = srv.app.state.serving.tok
    assert nxt.usage.input_tokens == len(tok.apply_chat_template(
        convo, tools=[WEATHER], add_generation_prompt=True))


def test_the_store_keeps_the_newest_and_forgets_unstored(srv, client):
    ids = [create(srv, client, input=f"n{i}", max_output_tokens=1).id
           for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # evicted: the store holds STORE_SIZE
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    unstored = create(srv, client, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=srv.model, input="y", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_expires_by_ttl():
    now = [0.0]
    store = ResponseStore(size=2, ttl=10, clock=lambda: now[0])
    store.put("a", {}, [])
    now[0] = 5
    store.put("b", {}, [])
    now[0] = 6
    store.put("c", {}, [])
    assert store.get("a") is None and store.get("b") is not None  # a: evicted by size
    now[0] = 15
    assert store.get("b") is None and store.get("c") is not None  # b: expired; c until 16
    now[0] = 16
    assert store.get("c") is None and len(store) == 0


@pytest.mark.parametrize("body,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "temperature": -1.0}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
     "text.format.schema"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({}, "input"),
])
def test_bad_requests_are_one_400_naming_the_field(srv, body, param):
    with srv.http() as h:
        r = h.post("/v1/responses", json={"model": srv.model, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    srv.wait_idle()


def test_reasoning_items_where_a_reasoning_parser_is_set(srv, client, monkeypatch):
    """deepseek_r1: the template opened the thinking, so an answer that never closes it (the random
    model's) is all reasoning: one reasoning item, streamed as reasoning_text events."""
    monkeypatch.setattr(srv.app.state.serving.cfg, "reasoning_parser", "deepseek_r1")
    kw = {"input": QUESTION, "max_output_tokens": 6, "temperature": 0}
    r = create(srv, client, **kw)
    want = client.completions.create(model=srv.model, max_tokens=6, temperature=0, prompt=(
        srv.app.state.serving.tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True))).choices[0].text
    assert [o.type for o in r.output] == ["reasoning"]
    assert r.output[0].content[0].text == want
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events = responses_events(srv, {"model": srv.model, "stream": True, **kw})
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == want


def test_a_client_that_leaves_mid_stream_frees_its_request(srv):
    before = aborted(srv)
    with srv.http() as h, h.stream("POST", "/v1/responses", json={
            "model": srv.model, "input": QUESTION, "max_output_tokens": 1500,
            "stream": True}) as r:
        next(r.iter_lines())  # response.created: the request is running
    assert srv.wait_idle()["num_running"] == 0
    assert aborted(srv) == before + 1
