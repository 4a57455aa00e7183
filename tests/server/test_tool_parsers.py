"""Tool-call and reasoning parsers on fixed strings; streamed in arbitrary chunks, same result."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.server.output_parser import OutputParser
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS, FunctionCall, JsonArrayToolParser

W = {"city": "Oslo", "unit": "c"}
CALL_W = FunctionCall("get_weather", json.dumps(W))
CALL_T = FunctionCall("get_time", json.dumps({"tz": "CET"}))

# (parser, text, content, calls)
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
               "\n</tool_call>"), "", [CALL_W]),
    ("hermes", ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Oslo", "unit": "c"}}</tool_call>\n<tool_call>{"name": "get_time", '
               '"arguments": {"tz": "CET"}}</tool_call>'), "Let me check.\n\n", [CALL_W, CALL_T]),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after",
     []),
    ("hermes", 'a <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}', "a ", [CALL_T]),
    ("hermes", "a < b and <tool_", "a < b and <tool_", []),
    ("qwen", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>',
     "", [CALL_T]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', "",
     [CALL_W]),
    ("llama3", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
               '; {"name": "get_time", "parameters": {"tz": "CET"}}'), "", [CALL_W, CALL_T]),
    ("llama3", "The weather is nice.", "The weather is nice.", []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},'
                ' {"name": "get_time", "arguments": {"tz": "CET"}}]'), "", [CALL_W, CALL_T]),
    ("mistral", "Sure. [TOOL_CALLS][]", "Sure. [TOOL_CALLS][]", []),
    ("mistral", "No calls [TOOL", "No calls [TOOL", []),
]


def chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        out.append(text[i:i + n])
        i += n
    return out


def streamed(parser: OutputParser, text: str, seed: int):
    inc = parser.stream()
    content, reasoning, calls = "", "", []
    parts = chunks(text, seed)
    for k, c in enumerate(parts):
        d = inc.feed(c, final=k == len(parts) - 1)
        content, reasoning, calls = content + d.content, reasoning + d.reasoning, calls + d.calls
    return content, reasoning, calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_tool_parser_whole_and_streamed(name, text, content, calls):
    p = OutputParser(tools=TOOL_PARSERS[name]())
    got = p.extract(text)
    assert (got.content, got.calls) == (content, calls)
    for seed in range(5):
        assert streamed(p, text, seed) == (content, "", calls)


def test_streamed_calls_appear_once_complete_and_content_never_shows_markers():
    p = OutputParser(tools=TOOL_PARSERS["hermes"]())
    text = CASES[2][1]
    inc = p.stream()
    seen = ""
    for c in text:
        d = inc.feed(c)
        seen += d.content
        assert "<" not in seen
        for call in d.calls:
            assert json.loads(call.arguments)
    assert seen == "Let me check.\n\n"


def test_json_array_parser_for_forced_calls():
    p = OutputParser(tools=JsonArrayToolParser())
    text = '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}},' \
           '{"name":"get_time","arguments":{"tz":"CET"}}]'
    assert p.extract(text).calls == [CALL_W, CALL_T]
    assert p.extract(text).content == ""
    for seed in range(5):
        assert streamed(p, text, seed) == ("", "", [CALL_W, CALL_T])
    # cut off by max_tokens: the complete calls survive
    assert p.extract(text[:-10]).calls == [CALL_W]


R_CASES = [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "Paris."),
    ("qwen3", "Paris.", "", "Paris."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "a <think>b</think>", "", "a <think>b</think>"),
    ("deepseek_r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),
    ("deepseek_r1", "<think>x</think>\ny", "x", "y"),
    ("deepseek_r1", "never closed </thin", "never closed </thin", ""),
]


@pytest.mark.parametrize("name, text, reasoning, content", R_CASES)
def test_reasoning_parser_whole_and_streamed(name, text, reasoning, content):
    p = OutputParser(reasoning=REASONING_PARSERS[name]())
    got = p.extract(text)
    assert (got.reasoning, got.content) == (reasoning, content)
    for seed in range(5):
        assert streamed(p, text, seed) == (content, reasoning, [])


def test_reasoning_then_tool_calls():
    p = OutputParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
    text = ('<think>I need the weather. <tool_call>{"name": "x", "arguments": {}}</tool_call>'
            '</think>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    got = p.extract(text)
    assert got.calls == [CALL_T]  # a call inside the thinking is not made
    assert "x" in got.reasoning and got.content == ""
    for seed in range(5):
        assert streamed(p, text, seed) == ("", got.reasoning, [CALL_T])
