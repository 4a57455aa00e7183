"""Tool calls out of model text, one parser per model family's format (`--tool-call-parser`).

Every parser answers one question, `extract(text, final)`: which part of `text` is content and
which complete calls it holds. With `final=False` (streaming) it keeps back whatever may still turn
into a call (a half-written marker, an unfinished call), so the content and calls it reports only
ever grow as text is added, and the stream's sum equals the whole answer's (output_parser.py).

- hermes / qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with
  content around them (Hermes, Qwen2.5, Qwen3).
- llama3: the answer is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`,
  optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional content (the
  marker is a special token: the server keeps special tokens in the text for this parser).
- json_array: the `[{"name", "arguments"}]` array that tool_choice "required" or a named function
  forces with a grammar (structured.spec.ToolCallSpec); no flag selects it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(slots=True)
class Parsed:
    """One answer split up; every field only grows as more text arrives."""

    content: str = ""
    reasoning: str = ""
    calls: list[FunctionCall] = field(default_factory=list)


def _call(obj, args_key: str = "arguments") -> FunctionCall | None:
    """A {"name": str, <args_key>: object} dict as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (kept back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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
            j = text.find(self.end, i)
            body = text[i + len(self.start): j if j >= 0 else len(text)]
            if j < 0 and not final:
                return out  # an unfinished call: wait for its end
            call = _call(_loads(body))
            if call is None:  # not a call after all: show it as it was written
                out.content += text[i: j + len(self.end) if j >= 0 else len(text)]
            else:
                out.calls.append(call)
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
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                break
            call = _call(obj, "parameters")
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        if not final or pos >= len(body):
            return Parsed(calls=calls)
        return Parsed(content=body[pos:] if calls else text, calls=calls)  # text after the calls


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
        return Parsed(calls=_json_array_calls(text, final)[0])  # a cut-off tail is dropped


def _json_array_calls(text: str, final: bool) -> tuple[list[FunctionCall], str]:
    """The calls of a `[{...}, ...]` array, and the text after them that is not one (while
    streaming: nothing; an unfinished element is kept back)."""
    body = text.lstrip()
    if not body or body[0] != "[":
        return [], text if final else ""
    calls, pos = [], 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos < len(body) and body[pos] == "]":
            return calls, body[pos + 1:] if final else ""
        try:
            obj, end = _DECODER.raw_decode(body, pos)
            call = _call(obj)
        except ValueError:
            call = None
        if call is None:
            return calls, body[pos:] if final else ""
        calls.append(call)
        pos = end


def _loads(body: str):
    try:
        return json.loads(body)
    except ValueError:
        return None


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when exactly one format's marker appears in it."""
    markers = {"hermes": HermesToolParser.start, "mistral": MistralToolParser.marker,
               "llama3": Llama3JsonToolParser.tag}
    found = [name for name, m in markers.items() if m in (chat_template or "")]
    return found[0] if len(found) == 1 else None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
