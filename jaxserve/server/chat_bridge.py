"""The one conversion layer between the chat-shaped APIs (OpenAI Responses, Anthropic Messages) and
the engine's chat path.

A protocol module turns its request into an OpenAI chat request (a dict), and this module runs it
through OpenAIServing.plan_chat / submit / wait: the same template, tool plan, grammar, limits,
admission, disconnect handling and engine as /v1/chat/completions. What comes back is protocol-
neutral: an answer as a list of Blocks (reasoning, text, function calls, in the order written), or,
streamed, Open / Piece / Close events per block and one Finished. Both APIs are block-shaped
(Responses' output items, Messages' content blocks), so they only rename what they get.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import ValidationError
from starlette.requests import Request

from jaxserve.server import protocol as P
from jaxserve.server.errors import APIError, from_validation_error
from jaxserve.server.output_parser import Delta
from jaxserve.server.responses import Kind
from jaxserve.server.serving import OpenAIServing


@dataclass(slots=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Block:
    kind: str  # "reasoning" | "text" | "call"
    index: int  # its place in the answer
    text: str = ""  # the text, the reasoning, or a call's JSON arguments
    name: str | None = None  # a call's function
    call_id: str | None = None


@dataclass(slots=True)
class Answer:
    blocks: list[Block]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    stop_sequence: str | None  # the stop string that ended it
    usage: Usage


@dataclass(slots=True)
class BlockEvent:
    block: Block


class Open(BlockEvent):
    """The block begins."""

    __slots__ = ()


@dataclass(slots=True)
class Piece(BlockEvent):
    """More of the block's text."""

    delta: str


class Close(BlockEvent):
    """The block is whole."""

    __slots__ = ()


@dataclass(slots=True)
class Finished:
    finish_reason: str
    stop_sequence: str | None
    usage: Usage
    blocks: list[Block] = field(default_factory=list)


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """`e` naming the protocol's own field where the chat path named its chat twin
    (names: chat field -> the protocol's, e.g. max_tokens -> max_output_tokens)."""
    param = e.param or ""
    for chat, own in names.items():
        if param == chat or param.startswith((chat + "[", chat + ".")):
            new = own + param[len(chat):]
            msg = e.message.replace(f"'{param}'", f"'{new}'").replace(f"'{chat}'", f"'{own}'")
            out = APIError(e.status, msg, param=new, code=e.code)
            out.type = e.type
            return out
    return e


class ChatRun:
    """One chat-shaped call: planned (count_tokens stops there), then submitted and read."""

    def __init__(self, serving: OpenAIServing, kind: Kind, params, model: str, call_prefix: str):
        self.serving, self.kind, self.params, self.model = serving, kind, params, model
        self.call_prefix = call_prefix
        self.stream = None
        self.api_id = ""

    @classmethod
    async def plan(cls, serving: OpenAIServing, chat: dict, names: dict[str, str],
                   call_prefix: str = "call_") -> ChatRun:
        try:
            req = P.ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # what only the chat model checks (e.g. a tool's name)
            err = from_validation_error(e.errors(include_input=False))
            # both protocols write a tool's fields where chat nests them under `function`
            flat = re.sub(r"^(tools\[\d+\])\.function", r"\1", err.param or "")
            if flat != err.param:
                err = APIError(400, err.message.replace(err.param, flat), param=flat, code=err.code)
            raise renamed(err, names) from None
        try:
            kind, params, model = await serving.plan_chat(req)
        except APIError as e:
            raise renamed(e, names) from None
        return cls(serving, kind, params, model, call_prefix)

    @property
    def prompt_ids(self) -> list[int]:
        return self.kind.prompts[0].ids

    async def submit(self, id_prefix: str) -> str:
        self.api_id, self.stream = await self.serving.submit(self.kind, self.params, id_prefix)
        return self.api_id

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()

    def _new_call_id(self) -> str:
        return f"{self.call_prefix}{uuid.uuid4().hex[:24]}"

    def _usage(self, out) -> Usage:
        return Usage(len(self.prompt_ids), sum(len(o.token_ids) for o in out.outputs),
                     out.num_cached_tokens)

    @staticmethod
    def _finish(reason: str, stop_reason, made_calls: bool) -> tuple[str, str | None]:
        if made_calls and reason == "stop":
            return "tool_calls", None
        return reason, stop_reason if isinstance(stop_reason, str) else None

    async def answer(self, request: Request) -> Answer:
        """The whole answer (a client that leaves first aborts it: 499)."""

        async def collect():
            final = None
            async for _, out in self.stream:
                if out.finished:
                    final = out
            return final

        out = await self.serving.wait(request, self.stream, collect())
        o = out.outputs[0]
        if self.kind.output is not None:
            parsed = self.kind.output.extract(o.text)
            parts = [("reasoning", parsed.reasoning), ("text", parsed.content)]
            calls = parsed.calls
        else:
            parts, calls = [("text", o.text)], []
        blocks = [Block(kind, i, text) for i, (kind, text) in enumerate(
            (k, t) for k, t in parts if t and (k != "text" or t.strip() or not calls))]
        for c in calls:
            blocks.append(Block("call", len(blocks), c.arguments, c.name, self._new_call_id()))
        if not blocks:
            blocks.append(Block("text", 0, ""))
        reason, stop = self._finish(o.finish_reason, o.stop_reason, bool(calls))
        return Answer(blocks, reason, stop, self._usage(out))

    async def events(self) -> AsyncIterator[Open | Piece | Close | Finished]:
        """The answer as block events; an engine failure raises out of the iteration."""
        blocks: list[Block] = []
        current: Block | None = None
        calls: dict[int, Block] = {}
        inc = self.kind.output.stream() if self.kind.output is not None else None
        last = None

        def switch(kind: str, **kw):
            nonlocal current
            if current is not None:
                yield Close(current)
            current = Block(kind, len(blocks), **kw)
            blocks.append(current)
            yield Open(current)

        try:
            async for _, out in self.stream:
                last = out
                o = out.outputs[0]
                if not (o.delta_text or o.finished):
                    continue
                d = inc.feed(o.delta_text, final=o.finished) if inc else Delta(o.delta_text)
                for kind, text in (("reasoning", d.reasoning), ("text", d.content)):
                    if not text:
                        continue
                    if current is None or current.kind != kind:
                        for e in switch(kind):
                            yield e
                    current.text += text
                    yield Piece(current, text)
                for c in d.calls:
                    if c.name is not None:
                        for e in switch("call", name=c.name, call_id=self._new_call_id()):
                            yield e
                        calls[c.index] = current
                    b = calls[c.index]
                    if c.arguments:
                        b.text += c.arguments
                        yield Piece(b, c.arguments)
                if o.finished:
                    break
        finally:
            self.stream.abort()  # no-op once finished; frees the blocks of a stream cut short
        if current is None:  # an empty answer is one empty text block
            for e in switch("text"):
                yield e
        yield Close(current)
        if last is None or not last.outputs[0].finished:
            yield Finished("abort", None, self._usage(last) if last else Usage(
                len(self.prompt_ids), 0, 0), blocks)
            return
        o = last.outputs[0]
        reason, stop = self._finish(o.finish_reason, o.stop_reason, bool(calls))
        yield Finished(reason, stop, self._usage(last), blocks)
