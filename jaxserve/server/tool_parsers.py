"""Tool calls out of model text, one parser per model family's format (`--tool-call-parser`).

Every parser answers one question, `extract(text, final)`: which part of `text` is content and
which calls it holds. A call counts from the moment its name is written; its arguments are the
model's own text of the arguments object, as far as it has been written (an unfinished call, e.g.
cut by max_tokens, keeps what it has). With `final=False` (streaming) a parser keeps back whatever
may still turn into a call (a half-written marker, an object whose name is not written yet), so
the content, the calls and each call's arguments only ever grow as text is added: the stream
sends what grew (output_parser.py), and its sum equals the whole answer's.

- hermes / qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with
  content around them (Hermes, Qwen2.5, Qwen3).
- llama3: the answer is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`,
  optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional content (the
  marker is a special token: the server keeps special tokens in the text for this parser).
- gpt_oss: harmony messages to a function, `<|start|>assistant<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (server/harmony.py, where the
  parsing lives), any number, and calls to built-in tools (`to=browser.search`, `to=python`) the
  request declared by that name; an undeclared built-in call is not content; every other
  message's body is.
- json_array: the `[{"name", "arguments"}]` array that tool_choice "required" or a named function
  forces with a grammar (structured.spec.ToolCallSpec); no flag selects it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from jaxserve.server import harmony

_WS = " \t\r\n"


@dataclass(frozen=True, slots=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text of the arguments object (a prefix of it while unfinished)


@dataclass(slots=True)
class Parsed:
    """One answer split up; every field only grows as more text arrives."""

    content: str = ""
    reasoning: str = ""
    calls: list[FunctionCall] = field(default_factory=list)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (kept back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _skip(text: str, i: int, chars: str = _WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


_STRUCTURE = re.compile(r'["\\{}\[\]]')  # the only characters _value_end has to look at


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at text[i] ends, by its structure (brackets, strings); None
    if the text stops before it does. (Streaming re-reads a call's text at every token: the
    regex skips the plain characters in C.)"""
    if text[i] not in '"{[':  # a number, true, false, null: up to the next delimiter
        j = i
        while j < len(text) and text[j] not in _WS + ",}]":
            j += 1
        return j if j < len(text) else None
    depth, in_str, escaped = 0, False, -1
    for m in _STRUCTURE.finditer(text, i):
        j, ch = m.start(), m.group()
        if in_str:
            if ch == "\\":
                if escaped != j:  # not itself escaped: the next character is
                    escaped = j + 1
            elif ch == '"' and escaped != j:
                in_str = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(slots=True)
class CallScan:
    """A `{"name": ..., <args_key>: ...}` object read from some position of a text."""

    call: FunctionCall | None  # None: not a call (yet: see `undecided`)
    end: int | None = None  # just after the object; None while it is unfinished
    undecided: bool = False  # more text may still make it a call


def scan_call(text: str, pos: int, args_keys: tuple[str, ...] = ("arguments",)) -> CallScan:
    """The call object starting at text[pos] (after blanks), read as far as the text goes.

    The call exists once its name is complete; its arguments are the object's own text while it
    is written (`{"a": 1` before `{"a": 1}`), a JSON string's content once that string is
    complete, "{}" when the object closes without them. An object that is not a call (no name, a
    name that is not a string, not JSON) says so as soon as that is certain.
    """
    i = _skip(text, pos)
    if i == len(text):
        return CallScan(None, undecided=True)
    if text[i] != "{":
        return CallScan(None)
    i += 1
    name: str | None = None
    args, args_done = "", False

    def result(end: int | None) -> CallScan:
        if name is None:
            return CallScan(None, end, undecided=end is None)
        return CallScan(FunctionCall(name, args if args or end is None else "{}"), end)

    while True:
        i = _skip(text, i, _WS + ",")
        if i == len(text):
            return result(None)
        if text[i] == "}":
            return result(i + 1)
        if text[i] != '"':
            return result(i) if name is not None else CallScan(None)
        key_end = _value_end(text, i)
        if key_end is None:
            return result(None)
        key = _loads(text[i:key_end])
        i = _skip(text, key_end)
        if i == len(text) and key is not None:
            return result(None)
        if key is None or text[i] != ":":
            return result(i) if name is not None else CallScan(None)
        i = _skip(text, i + 1)
        if i == len(text):
            return result(None)
        end = _value_end(text, i)
        if key == "name" and name is None:
            if end is None:
                return result(None)
            value = _loads(text[i:end])
            if not isinstance(value, str):
                return CallScan(None)
            name = value
        elif key in args_keys and not args_done:
            if text[i] == "{":  # the object's text, as far as it is written
                args, args_done = text[i:end], end is not None
                if end is None:
                    args = text[i:]
            elif end is not None:  # a JSON string holding the object, or any other value
                value = _loads(text[i:end])
                args, args_done = value if isinstance(value, str) else text[i:end], True
        if end is None:
            return result(None)
        i = end


class ToolParser:
    name = ""
    skip_special_tokens = True  # False where the call marker is a special token

    def extract(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def extract(self, text: str, final: bool) -> Parsed:
        out, pos = Parsed(), 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                out.content += tail if final else tail[: len(tail) - held_prefix(tail, self.start)]
                return out
            out.content += text[pos:i]
            scan = scan_call(text, i + len(self.start))
            if scan.call is not None:
                out.calls.append(scan.call)
                j = -1 if scan.end is None else text.find(self.end, scan.end)
            else:
                j = text.find(self.end, i)
                if not final and (j < 0 or scan.undecided):
                    return out  # may still become a call, or its end is not written yet
                # not a call after all: show it as it was written
                out.content += text[i: j + len(self.end) if j >= 0 else len(text)]
            if j < 0:
                return out
            pos = j + len(self.end)


class Llama3JsonToolParser(ToolParser):
    name = "llama3"
    tag = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        elif not final and self.tag.startswith(body):
            return Parsed()  # may still become the tag
        if not final and not body:
            return Parsed()
        if not body.startswith("{"):
            return Parsed(content=text)  # a plain answer
        calls, pos = _calls(body, 0, ("parameters", "arguments"), ";")
        if pos is None:  # unfinished
            return Parsed(calls=calls) if calls or not final else Parsed(content=text)
        if not calls:
            return Parsed(content=text)  # a JSON answer, not a call
        rest = body[pos:]
        return Parsed(content=rest if final else "", calls=calls)  # text after the calls


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    marker = "[TOOL_CALLS]"

    def extract(self, text: str, final: bool) -> Parsed:
        i = text.find(self.marker)
        if i < 0:
            return Parsed(content=text if final else text[: len(text) - held_prefix(text,
                                                                                      self.marker)])
        calls, rest = _json_array_calls(text[i + len(self.marker):], final)
        if not calls and final:
            return Parsed(content=text)  # a marker without calls: show it as written
        return Parsed(content=text[:i] + rest, calls=calls)


class JsonArrayToolParser(ToolParser):
    name = "json_array"

    def extract(self, text: str, final: bool) -> Parsed:
        return Parsed(calls=_json_array_calls(text, final)[0])


class GptOssToolParser(ToolParser):
    name = "gpt_oss"
    skip_special_tokens = False
    declared: frozenset[str] = frozenset()  # the request's function names (tools.plan): built-in tools it declared

    def extract(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        for m in harmony.parse(text, final):
            name = m.tool(self.declared)
            if name is None:
                if not m.builtin:  # an undeclared built-in tool's call is not content (server/harmony.py)
                    out.content += m.body
                continue
            args = m.body.lstrip()
            out.calls.append(FunctionCall(name, args if args or not m.done else "{}"))
        return out


def _calls(text: str, pos: int, args_keys: tuple[str, ...], separators: str
           ) -> tuple[list[FunctionCall], int | None]:
    """Consecutive call objects from text[pos], separated by blanks and `separators`: the calls
    (the last one possibly unfinished) and where the first non-call begins (None: the text ended
    inside a call, or before it was clear whether one follows)."""
    calls: list[FunctionCall] = []
    while True:
        scan = scan_call(text, pos, args_keys)
        if scan.call is not None:
            calls.append(scan.call)
        if scan.end is None and (scan.call is not None or scan.undecided):
            return calls, None
        if scan.call is None:
            return calls, pos
        pos = _skip(text, scan.end, _WS + separators)


def _json_array_calls(text: str, final: bool) -> tuple[list[FunctionCall], str]:
    """The calls of a `[{...}, ...]` array, and the text after them that is not one (while
    streaming: nothing)."""
    body = text.lstrip()
    if not body or body[0] != "[":
        return [], text if final else ""
    calls, pos = _calls(body, 1, ("arguments",), ",")
    if pos is None:
        return calls, ""
    if body[pos:pos + 1] == "]":
        pos += 1
    return calls, body[pos:] if final else ""


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when exactly one format's marker appears in it."""
    markers = {"hermes": HermesToolParser.start, "mistral": MistralToolParser.marker,
               "llama3": Llama3JsonToolParser.tag, "gpt_oss": "<|call|>"}
    found = [name for name, m in markers.items() if m in (chat_template or "")]
    return found[0] if len(found) == 1 else None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "gpt_oss": GptOssToolParser,
}
