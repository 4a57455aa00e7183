"""Tool-call and reasoning parsers on fixed strings; streamed in arbitrary chunks, same result
(each call's arguments rebuilt from the pieces a stream sends)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.server.output_parser import OutputParser, message_json
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS, FunctionCall, JsonArrayToolParser

W = {"city": "Oslo", "unit": "c"}
CALL_W = FunctionCall("get_weather", json.dumps(W))
CALL_T = FunctionCall("get_time", json.dumps({"tz": "CET"}))
NESTED = '{"q": "a}b\\"{ ]", "n": {"x": [1, {"y": 2}], "e": "\\\\"}}'  # braces in strings

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
    # an unfinished call (cut by max_tokens) keeps the arguments written so far
    ("hermes", 'a <tool_call>{"name": "get_time", "arguments": {"tz": "CE', "a ",
     [FunctionCall("get_time", '{"tz": "CE')]),
    ("hermes", 'x<tool_call>{"name": "get_ti', "x<tool_call>{\"name\": \"get_ti", []),
    ("hermes", '<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>', "",
     [CALL_T]),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>!', "!",
     [FunctionCall("get_time", "{}")]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>\n', "\n\n",
     [CALL_T, CALL_T]),
    ("hermes", '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
    ("hermes", '<tool_call>{"id": 7, "name": "f", "arguments": ' + NESTED + '}</tool_call>', "",
     [FunctionCall("f", NESTED)]),
    ("qwen", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>',
     "", [CALL_T]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', "",
     [CALL_W]),
    ("llama3", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
               '; {"name": "get_time", "parameters": {"tz": "CET"}}'), "", [CALL_W, CALL_T]),
    ("llama3", "The weather is nice.", "The weather is nice.", []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "f", "parameters": ' + NESTED + '} and then', "and then",
     [FunctionCall("f", NESTED)]),
    ("llama3", '{"name": "get_time", "parameters": {"tz"', "",
     [FunctionCall("get_time", '{"tz"')]),
    ("mistral", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},'
                ' {"name": "get_time", "arguments": {"tz": "CET"}}]'), "", [CALL_W, CALL_T]),
    ("mistral", "Sure. [TOOL_CALLS][]", "Sure. [TOOL_CALLS][]", []),
    ("mistral", "No calls [TOOL", "No calls [TOOL", []),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "f", "arguments": ' + NESTED + '}]', "Ok ",
     [FunctionCall("f", NESTED)]),
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
        content, reasoning = content + d.content, reasoning + d.reasoning
        for piece in d.calls:
            if piece.name is not None:  # a call's first delta
                assert piece.index == len(calls)
                calls.append([piece.name, piece.arguments])
            else:
                assert piece.arguments
                calls[piece.index][1] += piece.arguments
    return content, reasoning, [FunctionCall(n, a) for n, a in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_tool_parser_whole_and_streamed(name, text, content, calls):
    p = OutputParser(tools=TOOL_PARSERS[name]())
    got = p.extract(text)
    assert (got.content, got.calls) == (content, calls)
    shown = message_json(got)["content"] or ""  # blank content beside calls is not shown
    for seed in range(5):
        assert streamed(p, text, seed) == (shown, "", calls)


def test_arguments_stream_piecewise_and_content_never_shows_markers():
    """Fed one character at a time: each call opens once with its name, then its arguments
    arrive in many pieces (parallel calls too), and no marker ever reaches the content."""
    p = OutputParser(tools=TOOL_PARSERS["hermes"]())
    text = CASES[2][1]
    inc = p.stream()
    seen, pieces = "", {0: [], 1: []}
    for c in text:
        d = inc.feed(c)
        seen += d.content
        assert "<" not in seen
        for piece in d.calls:
            assert (piece.name is not None) == (not pieces[piece.index])
            pieces[piece.index].append(piece.arguments)
    assert seen == "Let me check.\n\n"
    assert "".join(pieces[0]) == CALL_W.arguments and len(pieces[0]) > 10
    assert "".join(pieces[1]) == CALL_T.arguments and len(pieces[1]) > 5


def test_max_calls_keeps_the_first_calls():
    """parallel_tool_calls false under 'auto': only the first call, streamed or not."""
    p = OutputParser(tools=TOOL_PARSERS["hermes"](), max_calls=1)
    assert p.extract(CASES[2][1]).calls == [CALL_W]
    for seed in range(3):
        assert streamed(p, CASES[2][1], seed)[2] == [CALL_W]


def test_json_array_parser_for_forced_calls():
    p = OutputParser(tools=JsonArrayToolParser())
    text = '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}},' \
           '{"name":"get_time","arguments":{"tz":"CET"}}]'
    # the arguments as the model wrote them (compact here)
    calls = [FunctionCall("get_weather", '{"city":"Oslo","unit":"c"}'),
             FunctionCall("get_time", '{"tz":"CET"}')]
    assert p.extract(text).calls == calls
    assert p.extract(text).content == ""
    for seed in range(5):
        assert streamed(p, text, seed) == ("", "", calls)
    # cut off by max_tokens: the last call keeps what was written of it, streamed or not
    assert p.extract(text[:-10]).calls == [calls[0], FunctionCall("get_time", '{"tz')]
    assert streamed(p, text[:-10], 0)[2] == p.extract(text[:-10]).calls


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


ATOMS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"',
         ":", ",", " ", "\n", '"f"', '"x\\"y"', "1", "null", '"', "\\", "hi", "[TOOL_CALLS]",
         "<|python_tag|>", ";", "<think>", "</think>", "<tool", "call>", '"\\u00e9"',
         '{"name": "f", "arguments": {"a": [1, "}"]}}', '<tool_call>{"name": "g", "arguments": ']
PARSERS = {**{n: lambda n=n: OutputParser(tools=TOOL_PARSERS[n]())
              for n in ("hermes", "llama3", "mistral")},
           "json_array": lambda: OutputParser(tools=JsonArrayToolParser()),
           "r1+hermes": lambda: OutputParser(REASONING_PARSERS["deepseek_r1"](),
                                             TOOL_PARSERS["hermes"]())}


@settings(max_examples=300, deadline=None)
@given(atoms=st.lists(st.sampled_from(ATOMS), max_size=30), seed=st.integers(0, 2**16),
       name=st.sampled_from(sorted(PARSERS)))
def test_any_text_streams_to_the_whole_answer(atoms, seed, name):
    """Whatever the model writes, in whatever chunks: the stream only ever grows (the parser's
    asserts) and adds up to the whole answer, arguments included."""
    p, text = PARSERS[name](), "".join(atoms)
    whole = p.extract(text)
    shown = message_json(whole)["content"] or ""
    assert streamed(p, text, seed) == (shown, whole.reasoning, whole.calls)
