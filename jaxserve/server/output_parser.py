"""One choice's text split into reasoning, content and tool calls: whole, or as stream deltas.

The reasoning parser runs first (thinking is never parsed for calls), then the tool parser on the
content. Streaming re-extracts the text received so far and sends only what grew: both parsers
keep back what could still change, so the deltas add up to the whole answer's split. A tool call
streams as OpenAI's do: a first delta with its index, id, name and the arguments written so far,
then deltas that append to its arguments as the model writes them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.tool_parsers import FunctionCall, Parsed, ToolParser


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 max_calls: int | None = None):
        self.reasoning, self.tools = reasoning, tools
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only

    def extract(self, text: str, final: bool = True) -> Parsed:
        out = self.reasoning.extract(text, final) if self.reasoning else Parsed(content=text)
        if self.tools:
            t = self.tools.extract(out.content, final)
            out.content, out.calls = t.content, t.calls[: self.max_calls]
        return out

    def stream(self) -> Incremental:
        return Incremental(self)


@dataclass(slots=True)
class CallDelta:
    index: int  # the call's place among the choice's calls
    name: str | None  # in the call's first delta only
    arguments: str  # what its arguments grew by


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class Incremental:
    """Feed a choice's text deltas; get back what each adds to reasoning, content and calls."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.text = ""
        self.sent = Parsed()

    def feed(self, delta: str, final: bool = False) -> Delta:
        self.text += delta
        now = self.parser.extract(self.text, final)
        if not now.content.strip() and (now.calls or not final):
            now.content = ""  # blank so far: sent once text follows (an answer with calls has none)
        old = self.sent
        assert now.content.startswith(old.content) and now.reasoning.startswith(old.reasoning)
        out = Delta(now.content[len(old.content):], now.reasoning[len(old.reasoning):])
        for k, call in enumerate(now.calls):
            if k >= len(old.calls):
                out.calls.append(CallDelta(k, call.name, call.arguments))
                continue
            was = old.calls[k]
            assert call.name == was.name and call.arguments.startswith(was.arguments), (was, call)
            if len(call.arguments) > len(was.arguments):
                out.calls.append(CallDelta(k, None, call.arguments[len(was.arguments):]))
        assert len(now.calls) >= len(old.calls)
        self.sent = now
        return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: FunctionCall) -> dict:
    """OpenAI's tool_call object."""
    return {"id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def call_delta_json(d: CallDelta) -> dict:
    """A call's first delta carries its id, type and name; later ones only argument text."""
    if d.name is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, **tool_call_json(FunctionCall(d.name, d.arguments))}


def message_json(p: Parsed) -> dict:
    """The assistant message of a whole answer."""
    m: dict = {"role": "assistant",
               "content": None if p.calls and not p.content.strip() else p.content}
    if p.reasoning:
        m["reasoning_content"] = p.reasoning
    if p.calls:
        m["tool_calls"] = [tool_call_json(c) for c in p.calls]
    return m


def delta_json(d: Delta) -> dict:
    """A stream delta in OpenAI's shape: content, reasoning_content, tool-call pieces."""
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.calls:
        out["tool_calls"] = [call_delta_json(c) for c in d.calls]
    return out


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason
