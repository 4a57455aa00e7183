"""The OpenAI Responses API's request side: the request model, its `input` items and tools as an
OpenAI chat request, and the bounded store behind `previous_response_id` and GET/DELETE.

Input items served: messages (string or input_text/output_text parts; developer = system),
function_call and function_call_output items, and reasoning items (dropped from the prompt, as chat
templates drop earlier reasoning). Files, images, audio and built-in tools are a 400 naming them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.server.errors import APIError, bad_request

# chat field -> Responses field, for errors the chat path raises (most specific first)
NAMES = {
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


class _Strict(BaseModel):
    # Every field that would change the answer is either served or a 400 naming it.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: None = None  # not served: the model thinks as its chat template says
    summary: None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=0)  # no extra output to include
    background: Literal[False] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of content parts.", where)
    out = []
    for j, part in enumerate(content):
        t = part.get("type") if isinstance(part, dict) else None
        if t not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"Content part type {str(t)[:30]!r} is not supported: this server "
                              f"reads {' and '.join(TEXT_PARTS)} parts.", f"{where}[{j}]",
                              code="unsupported_parameter")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str):
        raise bad_request(f"'{where}.{name}' is required (a string).", f"{where}.{name}")
    return v


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict]:
    """`input` as chat messages; function_call items join the assistant turn before them."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    msgs: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}.",
                                  f"{where}.role")
            msgs.append({"role": role, "content": _parts_text(item.get("content"),
                                                              f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _field(item, "arguments", where)}}
            if not (msgs and msgs[-1]["role"] == "assistant"):
                msgs.append({"role": "assistant", "content": ""})
            msgs[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": _parts_text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad_request(f"Input item type {str(kind)[:40]!r} is not supported: send "
                              "messages, function_call, function_call_output or reasoning items.",
                              f"{where}.type", code="unsupported_parameter")
    return msgs


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"Tool type {str(t.get('type'))[:40]!r} is not supported: this "
                              "server serves function tools only.", f"tools[{i}].type",
                              code="unsupported_parameter")
        fn = {k: v for k, v in t.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise bad_request("Invalid 'tool_choice': give 'none', 'auto', 'required' or "
                          '{"type": "function", "name": ...}.', "tool_choice")
    return choice


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[dict, list[dict]]:
    """The request as an OpenAI chat request, and the conversation to store (without the
    instructions: a later turn sends its own)."""
    turn = history + input_messages(req.input)
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + turn
    chat: dict[str, Any] = {"model": req.model, "messages": msgs, "stream": req.stream}
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("tools", chat_tools(req.tools)),
                        ("tool_choice", chat_tool_choice(req.tool_choice)),
                        ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            chat[name] = value
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            if fmt.schema_ is None:
                raise bad_request("text.format of type 'json_schema' needs 'schema'.",
                                  "text.format.schema")
            js = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                  "description": fmt.description}
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in js.items() if v is not None}}
    return chat, turn


def output_messages(text: str, calls: list[tuple[str, str, str]]) -> list[dict]:
    """A response's output as the chat turn a later request continues from."""
    if not text and not calls:
        return []
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [{"id": cid, "type": "function",
                              "function": {"name": name, "arguments": args or "{}"}}
                             for cid, name, args in calls]
        for c in msg["tool_calls"]:  # history must parse: an unfinished call's text is dropped
            try:
                json.loads(c["function"]["arguments"])
            except ValueError:
                c["function"]["arguments"] = "{}"
    return [msg]


@dataclass(slots=True)
class Stored:
    body: dict  # the response as GET returns it
    conversation: list[dict]  # chat messages through this response's output
    expires: float


class ResponseStore:
    """Responses by id, at most `size` of them, each for `ttl` seconds; the oldest go first."""

    def __init__(self, size: int, ttl: float, clock=time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, body: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[rid] = Stored(body, conversation, self.clock() + self.ttl)
            self._items.move_to_end(rid)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            s = self._items.get(rid)
            if s is not None and s.expires <= self.clock():
                del self._items[rid]
                s = None
            return s

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404, f"No stored response with id {rid[:80]!r}: it was never stored (store: "
                    "false), was deleted, or expired from this server's store.", param=param,
                    code="response_not_found")
