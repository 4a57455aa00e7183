"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The request (system, content blocks: text, tool_use, tool_result; tools with input_schema;
tool_choice auto/any/tool/none; stop_sequences) becomes an OpenAI chat request and runs through
chat_bridge; the answer comes back as content blocks (thinking, text, tool_use), whole or as
Anthropic's stream (message_start, content_block_start/delta/stop, message_delta, message_stop).
Errors are in Anthropic's shape (errors.anthropic_error_body, chosen by path); the API key may come
as `x-api-key` (middleware.APIKey).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.async_engine import EngineDeadError
from jaxserve.server.chat_bridge import Answer, Block, ChatRun, Close, Finished, Open, Piece, Usage
from jaxserve.server.errors import APIError, anthropic_error_body, bad_request, internal_error
from jaxserve.server.request_checks import parse, shutting_down
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.streaming import EventStream, sse_event

log = logging.getLogger("jaxserve.server")

# chat field -> Messages field, for errors the chat path raises
NAMES = {"stop": "stop_sequences", "max_tokens": "max_tokens", "messages": "messages",
         "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "tool_choice"}
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class _Strict(BaseModel):
    # Every field that would change the answer is either served or a 400 naming it.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Block(_Strict):
    """A content block. A client that sends back an answer's blocks as it got them also sends the
    response-only fields it left unset (`citations: null`, `caller: null`): null ones are let pass."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, v: Any) -> Any:
        if isinstance(v, dict):
            v = {k: x for k, x in v.items() if x is not None or k in cls.model_fields}
        return v


class TextIn(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic
    citations: list[Any] | None = None


class ToolUseIn(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultIn(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextIn] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingIn(_Block):
    """An earlier turn's thinking: dropped from the prompt (as chat templates drop reasoning)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentIn = Annotated[TextIn | ToolUseIn | ToolResultIn | ThinkingIn, Field(discriminator="type")]


class MessageIn(_Strict):
    role: Literal["user", "assistant"]
    content: list[ContentIn]  # a string is one text block

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        for b in v if isinstance(v, list) else ():
            t = b.get("type") if isinstance(b, dict) else None
            if t not in BLOCK_TYPES:
                raise ValueError(f"content block type {str(t)[:30]!r} is not supported: this "
                                 f"server reads {', '.join(BLOCK_TYPES)} blocks")
        return v


class ToolIn(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # server tools (web search, ...) are not served
    cache_control: dict[str, Any] | None = None


class ToolChoiceIn(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfigIn(_Strict):
    type: Literal["disabled"]  # extended-thinking budgets are not served


class CountTokensRequest(_Strict):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfigIn | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used


def _text(content: str | list[TextIn] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def to_chat(req: CountTokensRequest) -> dict:
    """The request as an OpenAI chat request: tool_result blocks become tool messages, tool_use
    blocks the assistant's tool_calls."""
    msgs: list[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        texts, calls, results = [], [], 0
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, TextIn):
                texts.append(b.text)
            elif isinstance(b, ToolUseIn):
                if m.role != "assistant":
                    raise bad_request("tool_use blocks belong in assistant messages.", where)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input)}})
            elif isinstance(b, ToolResultIn):
                if m.role != "user":
                    raise bad_request("tool_result blocks belong in user messages.", where)
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id,
                             "content": _text(b.content)})
                results += 1
        if texts or calls or not results:
            msg: dict = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    chat: dict = {"model": req.model, "messages": msgs}
    if req.tools:
        chat["tools"] = []
        for i, t in enumerate(req.tools):
            chat["tools"].append({"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}})
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice of type 'tool' needs 'name'.", "tool_choice.name")
        chat["tool_choice"] = ({"type": "function", "function": {"name": tc.name}}
                               if tc.type == "tool" else {"any": "required"}.get(tc.type, tc.type))
        if tc.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, stream=req.stream)
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
    return chat


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish_reason]


def usage_json(u: Usage) -> dict:
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _input(arguments: str) -> dict:
    try:
        v = json.loads(arguments or "{}")
    except ValueError:  # cut short by max_tokens
        return {}
    return v if isinstance(v, dict) else {}


def block_json(b: Block, opening: bool = False) -> dict:
    """A content block, whole, or empty as content_block_start carries it."""
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if opening else b.text, "signature": ""}
    if b.kind == "call":
        return {"type": "tool_use", "id": b.call_id, "name": b.name,
                "input": {} if opening else _input(b.text)}
    return {"type": "text", "text": "" if opening else b.text}


def delta_json(b: Block, delta: str) -> dict:
    if b.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": delta}
    if b.kind == "call":
        return {"type": "input_json_delta", "partial_json": delta}
    return {"type": "text_delta", "text": delta}


class AnthropicMessages:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def count_tokens(self, request: Request) -> Response:
        req = await parse(CountTokensRequest, await self.serving.read_body(request))
        run = await ChatRun.plan(self.serving, to_chat(req), NAMES)
        return JSONResponse({"input_tokens": len(run.prompt_ids)})

    async def create(self, request: Request) -> Response:
        req = await parse(MessagesRequest, await self.serving.read_body(request))
        run = await ChatRun.plan(self.serving, to_chat(req), NAMES, "toolu_")
        msg_id = (await run.submit("msg")).replace("-", "_", 1)
        if req.stream:
            return EventStream(self._events(run, msg_id, req.model), run.abort)
        return JSONResponse(self._message(await run.answer(request), msg_id, req.model))

    @staticmethod
    def _message(a: Answer, msg_id: str, model: str) -> dict:
        return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [block_json(b) for b in a.blocks],
                "stop_reason": stop_reason(a.finish_reason, a.stop_sequence),
                "stop_sequence": a.stop_sequence, "usage": usage_json(a.usage)}

    async def _events(self, run: ChatRun, msg_id: str, model: str):
        start = {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": usage_json(Usage(len(run.prompt_ids), 0, 0))}
        yield sse_event("message_start", {"type": "message_start", "message": start})
        try:
            async for e in run.events():
                if isinstance(e, Open):
                    yield sse_event("content_block_start", {
                        "type": "content_block_start", "index": e.block.index,
                        "content_block": block_json(e.block, opening=True)})
                elif isinstance(e, Piece):
                    yield sse_event("content_block_delta", {
                        "type": "content_block_delta", "index": e.block.index,
                        "delta": delta_json(e.block, e.delta)})
                elif isinstance(e, Close):
                    yield sse_event("content_block_stop",
                                    {"type": "content_block_stop", "index": e.block.index})
                elif isinstance(e, Finished):
                    if e.finish_reason == "abort":  # by the server's shutdown timeout
                        yield sse_event("error", anthropic_error_body(shutting_down()))
                        return
                    yield sse_event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason(e.finish_reason, e.stop_sequence),
                                  "stop_sequence": e.stop_sequence},
                        "usage": usage_json(e.usage)})
            yield sse_event("message_stop", {"type": "message_stop"})
        except EngineDeadError as e:
            yield sse_event("error", anthropic_error_body(APIError(503, str(e))))
        except Exception:  # a bug: this stream ends with an error event, the server serves on
            log.exception("Unhandled error while streaming a message")
            yield sse_event("error", anthropic_error_body(internal_error()))
        finally:
            run.abort()
