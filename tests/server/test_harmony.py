"""gpt-oss's harmony output (`--reasoning-parser gpt_oss`, `--tool-call-parser gpt_oss`): answers as
gpt-oss writes them after the chat template's `<|start|>assistant` (reasoning then a final answer,
a tool call, two parallel calls, a preamble, the recipient in the role header, the stop token cut
or kept, built-in browser / python tool calls declared or not), whole and streamed one character
at a time and in random splits, giving the same split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.server.output_parser import OutputParser, message_json
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS, FunctionCall
from tests.server.test_tool_parsers import streamed

W = FunctionCall("get_weather", '{"location":"Oslo, Norway","unit":"celsius"}')
T = FunctionCall("get_time", '{"timezone": "Europe/Oslo"}')
THINK = "The user asks about the weather in Oslo. We should call get_weather with location Oslo, Norway."
CALL_W = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"location":"Oslo, Norway","unit":"celsius"}<|call|>')
CALL_T = ('<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
          '{"timezone": "Europe/Oslo"}<|call|>')

# (text, reasoning, content, calls)
SAMPLES = [
    # reasoning then the final answer (<|return|> is a stop token: cut from the text, or kept)
    ("<|channel|>analysis<|message|>User asks: \"What is 2+2?\" Simple: 4.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.",
     'User asks: "What is 2+2?" Simple: 4.', "2 + 2 = **4**.", []),
    ("<|channel|>analysis<|message|>Short answer.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Short answer.", "Hi!", []),
    # a tool call (<|call|> is a stop token too)
    (f"<|channel|>analysis<|message|>{THINK}<|end|>{CALL_W}", THINK, "", [W]),
    (f"<|channel|>analysis<|message|>{THINK}<|end|>{CALL_W[:-len('<|call|>')]}", THINK, "", [W]),
    # two parallel calls
    (f"<|channel|>analysis<|message|>Weather and time: call both.<|end|>{CALL_W}{CALL_T}",
     "Weather and time: call both.", "", [W, T]),
    # a preamble to the user on the commentary channel, then a call
    ("<|channel|>commentary<|message|>Let me look that up.<|end|>" + CALL_T, "", "Let me look that up.", [T]),
    # the recipient in the role header (right after the prompt's `<|start|>assistant`)
    (' to=functions.get_time<|channel|>commentary json<|message|>{"timezone": "Europe/Oslo"}<|call|>', "", "", [T]),
    # an answer without the format: all content
    ("Plain text, no channels.", "", "Plain text, no channels.", []),
]


def both():
    return OutputParser(REASONING_PARSERS["gpt_oss"](), TOOL_PARSERS["gpt_oss"]())


def one_char_at_a_time(parser, text):
    inc, content, reasoning, calls = parser.stream(), "", "", []
    for k, ch in enumerate(text):
        d = inc.feed(ch, final=k == len(text) - 1)
        content, reasoning = content + d.content, reasoning + d.reasoning
        for piece in d.calls:
            if piece.name is not None:
                calls.append([piece.name, piece.arguments])
            else:
                calls[piece.index][1] += piece.arguments
    return content, reasoning, [FunctionCall(n, a) for n, a in calls]


@pytest.mark.parametrize("text, reasoning, content, calls", SAMPLES)
def test_harmony_whole_and_streamed(text, reasoning, content, calls):
    p = both()
    got = p.extract(text)
    assert (got.reasoning, got.content, got.calls) == (reasoning, content, calls)
    shown = message_json(got)["content"] or ""
    assert one_char_at_a_time(p, text) == (shown, reasoning, calls)
    for seed in range(20):
        assert streamed(p, text, seed) == (shown, reasoning, calls)


def test_reasoning_parser_alone_keeps_calls_as_written():
    """Without the tool parser a call stays in the content, markup included; the final answer is
    its body only. The parsers need the special tokens in the text."""
    p = OutputParser(REASONING_PARSERS["gpt_oss"]())
    got = p.extract(SAMPLES[2][0])
    assert got.reasoning == THINK and got.content == CALL_W and not got.calls
    assert p.extract(SAMPLES[0][0]).content == "2 + 2 = **4**."
    assert not REASONING_PARSERS["gpt_oss"].skip_special_tokens and not TOOL_PARSERS["gpt_oss"].skip_special_tokens


def test_tool_parser_alone_reads_every_message():
    """Without the reasoning parser the analysis text is content (it is not dropped)."""
    got = OutputParser(tools=TOOL_PARSERS["gpt_oss"]()).extract(SAMPLES[4][0])
    assert got.calls == [W, T] and got.content == "Weather and time: call both."


def test_unfinished_call_keeps_its_arguments():
    text = CALL_W[: CALL_W.index("celsius")]
    got = both().extract(text)
    assert got.calls == [FunctionCall("get_weather", '{"location":"Oslo, Norway","unit":"')]


# gpt-oss's built-in tools, addressed from the analysis channel (browser, python) or commentary
SEARCH = '{"query": "Oslo weather today", "topn": 5}'
BUILTIN = ("<|channel|>analysis<|message|>Need current data: search.<|end|>"
           f"<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{SEARCH}<|call|>")
PYTHON = ("<|channel|>analysis<|message|>Compute it.<|end|>"
          "<|start|>assistant<|channel|>analysis to=python code<|message|>print(2 ** 100)<|call|>"
          "<|start|>assistant<|channel|>commentary to=browser.open code<|message|>{\"id\": 3}<|call|>")


def _check_streams(p, text, want):
    got = p.extract(text)
    assert (got.reasoning, got.content, got.calls) == want
    shown = message_json(got)["content"] or ""
    assert one_char_at_a_time(p, text) == (shown, want[0], want[2])
    for seed in range(20):
        assert streamed(p, text, seed) == (shown, want[0], want[2])


def test_undeclared_builtin_tool_calls_are_reasoning_not_content():
    """A request that declared no browser / python tool: the model's calls to them are its own
    work, shown as reasoning (both channels), never content or tool calls; the tool parser alone
    leaves them out of the content too."""
    _check_streams(both(), BUILTIN, ("Need current data: search.\n" + SEARCH, "", []))
    _check_streams(both(), PYTHON, ('Compute it.\nprint(2 ** 100)\n{"id": 3}', "", []))
    got = OutputParser(tools=TOOL_PARSERS["gpt_oss"]()).extract(PYTHON)
    assert got.content == "Compute it." and not got.calls


def test_declared_builtin_tools_are_tool_calls():
    """A request that declared functions named `browser.search` / `browser.open` / `python` gets
    the model's calls to them as tool calls, from either channel, whole and streamed."""
    from jaxserve.server import protocol as P
    from jaxserve.server.tools import plan

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("browser.search", "browser.open", "python")]
    req = P.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": tools})
    p = plan(req, "gpt_oss", "gpt_oss").output
    _check_streams(p, BUILTIN, ("Need current data: search.", "", [FunctionCall("browser.search", SEARCH)]))
    _check_streams(p, PYTHON, ("Compute it.", "", [FunctionCall("python", "print(2 ** 100)"),
                                                   FunctionCall("browser.open", '{"id": 3}')]))
    _check_streams(p, SAMPLES[2][0], (THINK, "", [W]))  # functions.* calls as before


ATOMS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f", " json",
         " to=python", " to=browser.search",
         "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|", "|>", "<", "{", '"a": 1', "}",
         " ", "hi", "to=", "\n"]


@settings(max_examples=300, deadline=None)
@given(atoms=st.lists(st.sampled_from(ATOMS), max_size=30), seed=st.integers(0, 2**16))
def test_any_harmony_text_streams_to_the_whole_answer(atoms, seed):
    p, text = both(), "".join(atoms)
    whole = p.extract(text)
    shown = message_json(whole)["content"] or ""
    assert streamed(p, text, seed) == (shown, whole.reasoning, whole.calls)


# A harmony chat template in gpt-oss's style (written for this test, not OpenAI's file): the
# constructs the real one uses - strftime_now, namespace, a macro, raise_exception, tojson of the
# call's arguments, the reasoning_effort kwarg, the call's recipient in the role header.
HARMONY_TEMPLATE = """\
{%- macro functions_namespace(tools) -%}
## functions

namespace functions {
{% for t in tools %}{% set f = t.function %}
// {{ f.description }}
type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions
{%- endmacro -%}
<|start|>system<|message|>You are a test model.
Current date: {{ strftime_now("%Y-%m-%d") }}

Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if messages[0].role in ("system", "developer") %}{% set dev, rest = messages[0].content, messages[1:] %}
{%- else %}{% set dev, rest = "", messages %}{% endif %}
{%- if dev or tools %}<|start|>developer<|message|>{% if dev %}# Instructions

{{ dev }}

{% endif %}{% if tools %}# Tools

{{ functions_namespace(tools) }}{% endif %}<|end|>{% endif %}
{%- set last = namespace(name=none) %}
{%- for m in rest %}
{%- if m.role == "user" %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" and m.tool_calls %}{% set c = m.tool_calls[0].function %}
{{- "<|start|>assistant to=functions." + c.name + "<|channel|>commentary json<|message|>" }}
{{- c.arguments | tojson }}<|call|>{% set last.name = c.name %}
{%- elif m.role == "assistant" %}
{%- if "<|channel|>" in m.content %}{{ raise_exception("pass the final text only") }}{% endif %}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content }}<|end|>
{%- elif m.role == "tool" %}
{%- if last.name is none %}{{ raise_exception("a tool message needs a call before it") }}{% endif %}
{{- "<|start|>functions." + last.name + " to=assistant<|channel|>commentary<|message|>" }}\
{{ m.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


def test_chat_template_renders_a_harmony_conversation(tmp_path):
    """The server's chat-template path (a model directory's chat_template.jinja, as HF ships
    gpt-oss's) renders the template with tools, a tool call turn and its result; the rendered
    call is read back by the gpt_oss tool parser as the same call."""
    import asyncio

    from jaxserve.server import protocol as P
    from jaxserve.server.chat_template import ChatTemplate
    from jaxserve.server.config import ServerConfig
    from jaxserve.tokenizer import Tokenizer
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    messages = [P.ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"location": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
    ]]
    template = ChatTemplate(tokenizer, ServerConfig(), lambda n, param: None)
    ids = asyncio.run(template.render(messages, template_kwargs={"reasoning_effort": "low"}, tools=[WEATHER_TOOL]))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>You are a test model.\nCurrent date: 20")
    assert "Reasoning: low" in text and "# Instructions\n\nAnswer briefly." in text
    assert "type get_weather = (_: {" in text and text.endswith("<|start|>assistant")
    call = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"location": "Oslo"}<|call|>')
    assert call + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>' in text
    # the assistant turn as the template wrote it, read back (after the prompt's `<|start|>assistant`)
    got = OutputParser(REASONING_PARSERS["gpt_oss"](), TOOL_PARSERS["gpt_oss"]()).extract(
        call[len("<|start|>assistant"):-len("<|call|>")])
    assert got.calls == [FunctionCall("get_weather", '{"location": "Oslo"}')] and got.content == ""
