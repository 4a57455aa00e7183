"""One choice's text split into reasoning, content and tool calls: whole, or as stream deltas.

The reasoning parser runs first (thinking is never parsed for calls), then the tool parser on the
content. Streaming re-extracts the text received so far and sends only what grew: both parsers
keep back what could still change, so the deltas add up to the whole answer's split.
"""

from __future__ import annotations

import uuid

from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.tool_parsers import FunctionCall, Parsed, ToolParser


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None):
        self.reasoning, self.tools = reasoning, tools

    def extract(self, text: str, final: bool = True) -> Parsed:
        out = self.reasoning.extract(text, final) if self.reasoning else Parsed(content=text)
        if self.tools:
            t = self.tools.extract(out.content, final)
            out.content, out.calls = t.content, t.calls
        return out

    def stream(self) -> Incremental:
        return Incremental(self)


class Incremental:
    """Feed a choice's text deltas; get back what each adds to reasoning, content and calls."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.text = ""
        self.sent = Parsed()

    def feed(self, delta: str, final: bool = False) -> Parsed:
        self.text += delta
        now = self.parser.extract(self.text, final)
        out = Parsed(content=now.content[len(self.sent.content):],
                     reasoning=now.reasoning[len(self.sent.reasoning):],
                     calls=now.calls[len(self.sent.calls):])
        self.sent = now
        return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: FunctionCall, index: int | None = None) -> dict:
    """OpenAI's tool_call object (with `index` in a stream delta)."""
    d = {"id": call_id(), "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def message_json(p: Parsed) -> dict:
    """The assistant message of a whole answer."""
    m: dict = {"role": "assistant",
               "content": None if p.calls and not p.content.strip() else p.content}
    if p.reasoning:
        m["reasoning_content"] = p.reasoning
    if p.calls:
        m["tool_calls"] = [tool_call_json(c) for c in p.calls]
    return m


def delta_json(d: Parsed, first_call_index: int) -> dict:
    """A stream delta: content, reasoning_content and whole tool calls (OpenAI's delta shape,
    each call in one delta with its index, id, name and arguments)."""
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.calls:
        out["tool_calls"] = [tool_call_json(c, first_call_index + k) for k, c in enumerate(d.calls)]
    return out


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason
