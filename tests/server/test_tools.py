"""Tools through a real server and the openai client, on a tiny random model whose tokenizer has a
tool-capable chat template (tests/fixtures/tool_chat_template.jinja).

The checks that need grammars in the engine (tool_choice required / named always give valid calls)
are skipped until the engine applies them; the rest (validation, template rendering, parsing the
model's free text, reasoning split) run now.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxserve.server.output_parser import OutputParser
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS, detect_tool_parser
from tests.server.agent_models import (
    AGENT_ENGINE,
    ENGINE_SUPPORTS_STRUCTURED,
    NEEDS_ENGINE,
    NOTE,
    TOOLS,
    WEATHER,
    with_tool_template,
)
from tests.server.conftest import ServerThread

needs_engine = pytest.mark.skipif(not ENGINE_SUPPORTS_STRUCTURED, reason=NEEDS_ENGINE)
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + [NOTE]}


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory):
    return with_tool_template(tiny_model("llama", max_pos=2048), tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def srv(tool_model):
    s = ServerThread(tool_model, AGENT_ENGINE, precompile=False, tool_call_parser="hermes",
                     reasoning_parser="deepseek_r1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(tool_model):
    """No parsers configured."""
    s = ServerThread(tool_model, AGENT_ENGINE, precompile=False)
    yield s
    s.stop()


def raw_text(s: ServerThread, messages, tools=None, max_tokens=12, **template_kw) -> str:
    """The model's greedy answer to the chat prompt, unparsed (through /v1/completions)."""
    tok = s.app.state.serving.tok
    ids = tok.apply_chat_template(messages, tools=tools, **template_kw)
    r = s.client().completions.create(model=s.model, prompt=ids, max_tokens=max_tokens,
                                      temperature=0)
    return r.choices[0].text


def collect_stream(stream, choice: int = 0):
    """Content, reasoning and tool calls of a streamed choice, rebuilt as a client would; each
    call also lists its argument pieces. Checks OpenAI's shape: a call's first delta carries its
    id, type and name, later ones only argument text; one finish_reason."""
    content, reasoning, calls, finishes = "", "", {}, []
    for chunk in stream:
        for c in chunk.choices:
            if c.index != choice:
                continue
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                first = tc.index not in calls
                assert bool(tc.id) == first and (tc.type == "function") == first, tc
                assert bool(tc.function.name) == first, tc
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name,
                                                   "arguments": "", "pieces": []})
                slot["arguments"] += tc.function.arguments or ""
                slot["pieces"].append(tc.function.arguments or "")
            finishes += [c.finish_reason] if c.finish_reason else []
    assert len(finishes) == 1, finishes
    assert sorted(calls) == list(range(len(calls)))
    return content, reasoning, [calls[i] for i in sorted(calls)], finishes[0]


def pairs(calls) -> list[tuple[str, str]]:
    """(name, arguments) of each call, streamed (dicts) or not (the client's objects)."""
    return [(c["name"], c["arguments"]) if isinstance(c, dict)
            else (c.function.name, c.function.arguments) for c in calls or []]


# ---- validation (runs now) -----------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parametrs": {}}}]},
     "tools[0].function.parametrs"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_requests_are_400s_naming_the_field(srv, kw, param):
    extra = {k: v for k, v in kw.items() if k not in ("tools", "tool_choice")}
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(
            model=srv.model, messages=USER, max_tokens=2, tools=kw.get("tools", openai.omit),
            tool_choice=kw.get("tool_choice", openai.omit), extra_body=extra or None)
    assert e.value.body["param"] == param, e.value.body


def test_auto_needs_a_tool_call_parser(server):
    """The plain tiny model's template shows no tool-call format, and no flag names one."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=server.model, messages=USER, max_tokens=2,
                                                tools=TOOLS)
    assert e.value.body["param"] == "tool_choice"
    assert "--tool-call-parser" in e.value.body["message"]
    # "none" needs no parser
    r = server.client().chat.completions.create(model=server.model, messages=USER, max_tokens=2,
                                                tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_the_parser_comes_from_the_template_when_unambiguous(plain):
    """No --tool-call-parser, but the fixture template writes <tool_call>: hermes is used."""
    assert plain.app.state.serving.tool_parser == "hermes"
    r = plain.client().chat.completions.create(model=plain.model, messages=USER, max_tokens=4,
                                               tools=TOOLS, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_detect_tool_parser():
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3"
    assert detect_tool_parser('{{- "<|start|>assistant to=functions." + name }}...<|call|>') == "gpt_oss"
    assert detect_tool_parser("<tool_call> [TOOL_CALLS]") is None  # ambiguous
    assert detect_tool_parser(None) is None


def test_bad_tool_call_arguments_in_history_are_a_400(srv):
    msgs = USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model=srv.model, messages=msgs, max_tokens=2,
                                             tools=TOOLS, tool_choice="none")
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


# ---- the chat template sees tools, calls and results (runs now) --------------------------------
def test_tools_calls_and_results_reach_the_chat_template(srv):
    tok = srv.app.state.serving.tok
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
    ]
    r = srv.client().chat.completions.create(model=srv.model, messages=history, max_tokens=1,
                                             tools=TOOLS, tool_choice="none")
    as_template = [dict(m) for m in history]
    as_template[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]}
    want = tok.apply_chat_template(as_template, tools=TOOLS)
    text = tok.decode(want, skip_special_tokens=False)
    assert "<tools>" in text and "get_time" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"' in text
    assert "<tool_response>sunny, 21</tool_response>" in text
    assert r.usage.prompt_tokens == len(want)
    no_tools = srv.client().chat.completions.create(model=srv.model, messages=USER, max_tokens=1)
    assert no_tools.usage.prompt_tokens < r.usage.prompt_tokens - 100


# ---- free text through the parsers (runs now) ---------------------------------------------------
def test_auto_and_reasoning_split_the_models_own_text(srv):
    """The answer is what the hermes + deepseek_r1 parsers make of the model's raw text, streamed
    or not; with the template's <think> opened, text before any </think> is reasoning."""
    kw = {"extra_body": {"chat_template_kwargs": {"think": True}}, "temperature": 0,
          "max_tokens": 12}
    raw = raw_text(srv, USER, TOOLS, think=True)
    want = OutputParser(REASONING_PARSERS["deepseek_r1"](), TOOL_PARSERS["hermes"]()).extract(raw)
    assert want.reasoning or want.content
    r = srv.client().chat.completions.create(model=srv.model, messages=USER, tools=TOOLS, **kw)
    m = r.choices[0].message
    assert (getattr(m, "reasoning_content", None) or "") == want.reasoning
    assert (m.content or "") == want.content
    assert bool(m.tool_calls) == bool(want.calls)
    s = srv.client().chat.completions.create(model=srv.model, messages=USER, tools=TOOLS,
                                             stream=True, **kw)
    content, reasoning, calls, finish = collect_stream(s)
    assert (content, reasoning) == (want.content, want.reasoning)
    assert len(calls) == len(m.tool_calls or [])
    assert finish == r.choices[0].finish_reason


def test_parsed_stream_still_carries_every_token_id(srv):
    """return_token_ids with the output parser on: a delta held back by the parser still sends
    its token ids, so the streamed ids add up to the whole answer's."""
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 12,
          "extra_body": {"return_token_ids": True, "chat_template_kwargs": {"think": True}}}
    whole = srv.client().chat.completions.create(**kw)
    want = whole.choices[0].model_extra["token_ids"]
    assert len(want) == whole.usage.completion_tokens
    got = []
    for chunk in srv.client().chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got += (c.model_extra or {}).get("token_ids") or []
    assert got == want


# ---- grammar-enforced calls (need the engine's wiring) ------------------------------------------
def _check_calls(calls, names):
    assert calls, "no tool call"
    for c in calls:
        name = c["name"] if isinstance(c, dict) else c.function.name
        args = c["arguments"] if isinstance(c, dict) else c.function.arguments
        assert name in names
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@needs_engine
@pytest.mark.parametrize("seed", range(4))
def test_required_always_gives_a_valid_call(srv, seed):
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "tool_choice": "required",
          "max_tokens": 400, "seed": seed, "temperature": 1.0, "parallel_tool_calls": False}
    c = srv.client().chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert len(c.message.tool_calls) == 1
    _check_calls(c.message.tool_calls, set(SCHEMAS))
    content, _, streamed, finish = collect_stream(srv.client().chat.completions.create(
        stream=True, **kw))
    assert (content, finish) == ("", "tool_calls")
    assert pairs(streamed) == pairs(c.message.tool_calls)


@needs_engine
def test_required_parallel_calls_are_each_valid(srv):
    """A random model may chain many calls: each parses, with distinct ids; one that max_tokens
    cut short keeps the arguments written so far, streamed and not. Streamed, each call has its
    index, and its arguments add up to the whole answer's."""
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "tool_choice": "required",
          "max_tokens": 600, "n": 3, "seed": 2, "temperature": 1.0}
    r = srv.client().chat.completions.create(**kw)
    chunks = list(srv.client().chat.completions.create(stream=True, **kw))
    for i, c in enumerate(r.choices):
        assert c.finish_reason in ("tool_calls", "length")
        calls = c.message.tool_calls
        _check_calls(calls if c.finish_reason == "tool_calls" else calls[:-1] or calls,
                     set(SCHEMAS))
        assert len({tc.id for tc in calls}) == len(calls)
        content, _, streamed, finish = collect_stream(chunks, i)
        assert (content, finish) == ("", c.finish_reason)
        assert pairs(streamed) == pairs(calls)


@needs_engine
@pytest.mark.parametrize("seed", range(3))
def test_named_function_streamed_and_not(srv, seed):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "tool_choice": choice,
          "max_tokens": 200, "seed": seed, "temperature": 1.0}
    r = srv.client().chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    _check_calls(calls, {"get_time"})
    content, _, streamed, finish = collect_stream(srv.client().chat.completions.create(
        stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    assert pairs(streamed) == pairs(calls)


@needs_engine
def test_long_arguments_stream_piecewise(srv):
    """Issue 17: a call streams as OpenAI's do, a first delta with index, id, type and name, then
    pieces appended to its arguments as the model writes them: many for a long argument, adding
    up to exactly the non-streamed arguments."""
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS + [NOTE], "max_tokens": 300,
          "tool_choice": {"type": "function", "function": {"name": "take_note"}}, "seed": 1,
          "temperature": 1.0}
    whole = srv.client().chat.completions.create(**kw).choices[0]
    _check_calls(whole.message.tool_calls, {"take_note"})
    content, _, streamed, finish = collect_stream(
        srv.client().chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("", whole.finish_reason) == ("", "tool_calls")
    assert pairs(streamed) == pairs(whole.message.tool_calls)
    assert len([p for p in streamed[0]["pieces"] if p]) > 10


def _two_calls_whole_and_streamed(client, kw):
    """get_weather then get_time, whole and streamed: the same calls, each streamed call's
    arguments in more than one piece, finish_reason tool_calls. Returns (whole choice, streamed)."""
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather", "get_time"]
    _check_calls(whole.message.tool_calls, set(SCHEMAS))
    content, _, streamed, finish = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("", "tool_calls")
    assert pairs(streamed) == pairs(whole.message.tool_calls)
    assert all(len([p for p in c["pieces"] if p]) > 1 for c in streamed)
    return whole, streamed


@needs_engine
def test_auto_parallel_calls_stream_by_index(srv):
    """Two hermes calls written by the model under 'auto': index 0 then 1, each opened once and
    its arguments in pieces; streamed and not agree exactly; finish_reason "tool_calls"."""
    regex = (r'[a-z]{1,4}</think>\n<tool_call>\{"name": "get_weather", "arguments": \{"city": '
             r'"[a-z]{8,12}", "unit": "celsius"\}\}</tool_call>\n<tool_call>\{"name": "get_time", '
             r'"arguments": \{"offset": [1-9]\}\}</tool_call>')
    kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "max_tokens": 300, "seed": 4,
          "temperature": 1.0, "extra_body": {"structured_outputs": {"regex": regex}}}
    whole, streamed = _two_calls_whole_and_streamed(srv.client(), kw)
    assert len({c["id"] for c in streamed}) == 2
    # parallel_tool_calls false: the first call only, streamed and not (as vLLM does)
    one = {**kw, "parallel_tool_calls": False}
    first = srv.client().chat.completions.create(**one).choices[0]
    assert pairs(first.message.tool_calls) == pairs(whole.message.tool_calls)[:1]
    _, _, streamed, finish = collect_stream(srv.client().chat.completions.create(stream=True, **one))
    assert (pairs(streamed), finish) == (pairs(whole.message.tool_calls)[:1], "tool_calls")


@needs_engine
def test_auto_parses_a_call_written_in_the_parsers_format(srv):
    """A grammar makes the random model think, then write a hermes call; 'auto' must find it
    (after the reasoning parser has taken the thinking)."""
    regex = (r'[a-z]{1,6}</think>\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
             r'"unit": "celsius"\}\}</tool_call>')
    for stream in (False, True):
        kw = {"model": srv.model, "messages": USER, "tools": TOOLS, "max_tokens": 200,
              "extra_body": {"structured_outputs": {"regex": regex}}}
        if stream:
            content, _, calls, finish = collect_stream(
                srv.client().chat.completions.create(stream=True, **kw))
        else:
            m = srv.client().chat.completions.create(**kw).choices[0]
            content, finish = m.message.content, m.finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in m.message.tool_calls]
        assert finish == "tool_calls" and not content, (finish, content)
        _check_calls(calls, {"get_weather"})


@needs_engine
def test_json_answers_are_content_not_reasoning(srv):
    """deepseek_r1 would read an answer without </think> as all thinking; a JSON grammar's
    answer is content."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = srv.client().chat.completions.create(
        model=srv.model, messages=USER, max_tokens=50, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).choices[0]
    assert json.loads(m.message.content) in ({"ok": True}, {"ok": False})
    assert not getattr(m.message, "reasoning_content", None)


@needs_engine
def test_reasoning_split_on_forced_think_output(srv):
    regex = r"[a-z ]{1,20}</think>\n[a-z ]{1,20}"
    kw = {"model": srv.model, "messages": USER, "max_tokens": 100, "extra_body": {
        "structured_outputs": {"regex": regex}, "chat_template_kwargs": {"think": True}}}
    m = srv.client().chat.completions.create(**kw).choices[0].message
    assert m.reasoning_content and "</think>" not in m.reasoning_content
    assert m.content and "</think>" not in m.content
    content, reasoning, _, _ = collect_stream(srv.client().chat.completions.create(
        stream=True, **{**kw, "seed": 0}))
    assert content and reasoning


LLAMA3_CALLS = (r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{8,12}", "unit": '
                r'"celsius"\}\}; \{"name": "get_time", "parameters": \{"offset": [1-9]\}\}')
MISTRAL_CALLS = (r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": '
                 r'"[a-z]{8,12}", "unit": "celsius"\}\}, \{"name": "get_time", "arguments": '
                 r'\{"offset": [1-9]\}\}\]')


@needs_engine
@pytest.mark.parametrize("parser, regex", [("llama3", LLAMA3_CALLS), ("mistral", MISTRAL_CALLS)])
def test_other_parsers_stream_arguments_piecewise(tool_model, parser, regex):
    """The llama3 and mistral formats under 'auto': two calls, index 0 and 1, arguments in
    pieces that add up to the non-streamed answer's."""
    s = ServerThread(tool_model, AGENT_ENGINE, precompile=False, tool_call_parser=parser)
    try:
        kw = {"model": s.model, "messages": USER, "tools": TOOLS, "max_tokens": 300, "seed": 0,
              "temperature": 1.0, "extra_body": {"structured_outputs": {"regex": regex}}}
        _two_calls_whole_and_streamed(s.client(), kw)
    finally:
        s.stop()
