"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The request (responses_input.py) becomes an OpenAI chat request and runs through chat_bridge; the
answer comes back as output items (reasoning, message, function_call), whole or as the typed event
stream (response.created, response.output_item.added, ...output_text.delta,
...function_call_arguments.delta, ..., response.completed). Stored responses (store, the default)
continue by `previous_response_id` from a bounded in-memory store (--responses-store-size/-ttl).
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.async_engine import EngineDeadError
from jaxserve.server.chat_bridge import Block, ChatRun, Close, Finished, Open, Piece, Usage
from jaxserve.server.errors import APIError, error_body, internal_error
from jaxserve.server.responses_input import (
    NAMES,
    ResponsesRequest,
    ResponseStore,
    not_found,
    output_messages,
    to_chat,
)
from jaxserve.server.request_checks import parse, shutting_down
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.streaming import EventStream, sse_event

log = logging.getLogger("jaxserve.server")
# A text block's streamed events per kind: the event name's stem and the fields its delta and done
# events add (output text carries logprobs, which this server does not return for responses).
TEXT_EVENTS = {"reasoning": ("response.reasoning_text", {}), "text": ("response.output_text", {"logprobs": []})}


def _hex() -> str:
    return uuid.uuid4().hex


class ResponseShape:
    """One response's JSON: the request's echo, its output items and status."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, tok):
        self.req, self.id, self.model, self.tok = req, rid, model, tok
        self.created = int(time.time())
        self.item_ids: dict[int, str] = {}

    def item_id(self, b: Block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[b.kind]
        return self.item_ids.setdefault(b.index, f"{prefix}_{_hex()}")

    def item(self, b: Block, done: bool = True) -> dict:
        status = "completed" if done else "in_progress"
        iid = self.item_id(b)
        if b.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": b.text}] if done else []
            return {"id": iid, "type": "reasoning", "summary": [], "content": content,
                    "status": status}
        if b.kind == "call":
            return {"id": iid, "type": "function_call", "call_id": b.call_id, "name": b.name,
                    "arguments": b.text if done else "", "status": status}
        return {"id": iid, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(b)] if done else []}

    @staticmethod
    def part(b: Block, text: str | None = None) -> dict:
        if b.kind == "reasoning":
            return {"type": "reasoning_text", "text": b.text if text is None else text}
        return {"type": "output_text", "text": b.text if text is None else text,
                "annotations": [], "logprobs": []}

    def usage(self, u: Usage, blocks: list[Block]) -> dict:
        thinking = "".join(b.text for b in blocks if b.kind == "reasoning")
        reasoning = len(self.tok.encode(thinking, add_special_tokens=False)) if thinking else 0
        return {"input_tokens": u.input_tokens,
                # cache_write_tokens: written by explicit caching, which this server has none of
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(reasoning, u.output_tokens)},
                "total_tokens": u.input_tokens + u.output_tokens}

    def body(self, status: str, blocks: list[Block] = (), usage: dict | None = None,
             finish_reason: str | None = None, error: dict | None = None) -> dict:
        r = self.req
        fmt = r.text.format if r.text and r.text.format else None
        tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")}
                 for t in r.tools or ()]
        choice = r.tool_choice or "auto"
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice["name"]}
        text_format = {"type": "text"}
        if fmt is not None:
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format.update(name=fmt.name or "response", schema=fmt.schema_,
                                   strict=fmt.strict, description=fmt.description)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if finish_reason == "length"
                                   else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "model": self.model,
            "output": [self.item(b) for b in blocks],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": text_format}, "tool_choice": choice, "tools": tools,
            "truncation": "disabled", "usage": usage, "user": r.user,
        }


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class OpenAIResponses:
    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving, self.store = serving, store

    async def get(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        s = self.store.get(rid)
        if s is None:
            raise not_found(rid)
        return JSONResponse(s.body)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            raise not_found(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def create(self, request: Request) -> Response:
        req = await parse(ResponsesRequest, await self.serving.read_body(request))
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = prev.conversation
        chat, turn = to_chat(req, history)
        run = await ChatRun.plan(self.serving, chat, NAMES)
        rid = "resp_" + (await run.submit("resp")).removeprefix("resp-")
        shape = ResponseShape(req, rid, run.model, self.serving.tok)
        if req.stream:
            return EventStream(self._events(run, shape, turn), run.abort)
        a = await run.answer(request)
        body = shape.body(status_of(a.finish_reason), a.blocks, shape.usage(a.usage, a.blocks),
                          a.finish_reason)
        self._keep(req, body, turn, a.blocks)
        return JSONResponse(body)

    def _keep(self, req: ResponsesRequest, body: dict, turn: list[dict], blocks: list[Block]):
        if not req.store:
            return
        text = "".join(b.text for b in blocks if b.kind == "text")
        calls = [(b.call_id, b.name, b.text) for b in blocks if b.kind == "call"]
        self.store.put(body["id"], body, turn + output_messages(text, calls))

    async def _events(self, run: ChatRun, shape: ResponseShape, turn: list[dict]):
        seq = 0

        def event(kind: str, **data) -> bytes:
            nonlocal seq
            seq += 1
            return sse_event(kind, {"type": kind, "sequence_number": seq - 1, **data})

        start = shape.body("in_progress")
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for e in run.events():
                b = getattr(e, "block", None)
                where = ({"item_id": shape.item_id(b), "output_index": b.index}
                         if b is not None else {})
                if isinstance(e, Open):
                    yield event("response.output_item.added", output_index=b.index,
                                item=shape.item(b, done=False))
                    if b.kind != "call":
                        yield event("response.content_part.added", **where, content_index=0,
                                    part=shape.part(b, ""))
                elif isinstance(e, (Piece, Close)):
                    # a call streams its arguments, a text block its text (TEXT_EVENTS); then done
                    done = isinstance(e, Close)
                    what = "arguments" if b.kind == "call" else "text"
                    value = {what: b.text} if done else {"delta": e.delta}
                    if b.kind == "call":
                        name, extra = "response.function_call_arguments", {}
                    else:
                        name, extra = TEXT_EVENTS[b.kind]
                        extra = {"content_index": 0, **extra}
                    yield event(f"{name}.{'done' if done else 'delta'}", **where, **extra, **value)
                    if done and b.kind != "call":
                        yield event("response.content_part.done", **where, content_index=0,
                                    part=shape.part(b))
                    if done:
                        yield event("response.output_item.done", output_index=b.index,
                                    item=shape.item(b))
                elif isinstance(e, Finished):
                    usage = shape.usage(e.usage, e.blocks)
                    if e.finish_reason == "abort":  # by the server's shutdown timeout
                        err = shutting_down()
                        body = shape.body("failed", e.blocks, usage, error={
                            "code": "server_error", "message": err.message})
                        yield event("response.failed", response=body)
                        return
                    body = shape.body(status_of(e.finish_reason), e.blocks, usage,
                                      e.finish_reason)
                    self._keep(shape.req, body, turn, e.blocks)
                    name = ("response.incomplete" if body["status"] == "incomplete"
                            else "response.completed")
                    yield event(name, response=body)
        except EngineDeadError as e:
            yield event("error", **self._error(APIError(503, str(e), code="engine_unavailable")))
        except Exception:  # a bug: this stream ends with an error event, the server serves on
            log.exception("Unhandled error while streaming a response")
            yield event("error", **self._error(internal_error()))
        finally:
            run.abort()

    @staticmethod
    def _error(e: APIError) -> dict:
        err = error_body(e)["error"]
        return {"code": err["code"], "message": err["message"], "param": err["param"]}
