"""The OpenAI endpoints that generate: /v1/completions and /v1/chat/completions.

Both follow one path: parse -> prompts to token ids -> SamplingParams -> admit (503 draining,
429 queue full) -> one engine request per prompt on one RequestStream -> SSE chunks or one JSON
body. They differ only in how a prompt is built and how a choice is shaped, which `_Kind` holds.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from jaxserve.server import protocol as P
from jaxserve.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.streaming import DONE, EventStream, sse, until_disconnect
from jaxserve.tokenizer import _byte_alphabet

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class _Prompt:
    ids: list[int]
    text: str | None = None


@dataclass
class _Kind:
    """What differs between completions and chat."""

    object: str  # "text_completion" | "chat.completion"
    chunk_object: str
    id_prefix: str
    params: P._SamplingRequest
    prompts: list[_Prompt]
    echo: bool = False
    aliases: dict[str, str] = field(default_factory=dict)


class OpenAIServing:
    def __init__(self, engine, aengine: AsyncEngine, cfg: ServerConfig, tokenizer):
        self.aengine = aengine
        self.cfg = cfg
        self.tok = tokenizer  # this thread's own copy: the engine thread uses the engine's
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.validate_prompt: Callable[[list[int]], None] = engine.validate_prompt  # pure: reads only limits
        self.defaults = dict(engine.loaded.generation_defaults)
        self.model_names = list(cfg.served_model_names or [engine.loaded.name])
        self.draining = False
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    # ---- shared checks -----------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        too_big = APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="body_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            body.append(chunk)
        return b"".join(body)

    def check_model(self, name: str | None) -> str:
        if name in (None, ""):
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model {name[:100]!r} does not exist: this server serves "
                           f"{', '.join(map(repr, self.model_names))}.", param="model", code="model_not_found")
        return name

    def admit(self, num_requests: int) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down: retry on another instance.", code="shutting_down")
        reason = self.aengine.health()
        if reason is not None:
            raise APIError(503, reason, code="engine_unavailable")
        queued = self.aengine.num_queued
        if queued + num_requests > self.cfg.max_queued_requests:
            raise APIError(429, f"Too many requests waiting ({queued}, limit {self.cfg.max_queued_requests}): "
                           "retry later.", code="queue_full")

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return t

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (a byte-level token may hold part of a UTF-8 character)."""
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = list(_raw_bytes(self.tok, token_id) or self.token_text(token_id).encode())
        return b

    def check_lengths(self, prompts: list[_Prompt], max_tokens: int | None, param: str) -> None:
        for p in prompts:
            try:
                self.validate_prompt(p.ids)
            except ValueError as e:
                raise from_value_error(e, default_param="messages" if param == "max_completion_tokens" else "prompt")
            if max_tokens is not None and len(p.ids) + max_tokens > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens, but {len(p.ids) + max_tokens} "
                    f"were requested ({len(p.ids)} in the prompt, {max_tokens} to generate): "
                    f"shorten the prompt or lower '{param}'.", param, code="context_length_exceeded")

    # ---- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await self.read_body(request))
        req.check_stream_options()
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("'suffix' is not supported.", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request("'echo' with 'logprobs' needs prompt logprobs, which this server does not compute.",
                              "echo")
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        prompts = [_Prompt(self.tok.encode(p), p) if isinstance(p, str) else _Prompt(list(p)) for p in raw]
        self.check_lengths(prompts, req.max_tokens, "max_tokens")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, self.max_model_len - max(len(p.ids) for p in prompts))
        kind = _Kind("text_completion", "text_completion", "cmpl", req, prompts, echo=req.echo)
        params = P.to_sampling_params(req, defaults=self.defaults, max_tokens=max_tokens, logprobs=req.logprobs,
                                      vocab_size=self.vocab_size, aliases={})
        return await self._generate(request, kind, params, model)

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = P.parse(P.ChatCompletionRequest, await self.read_body(request))
        req.check_stream_options()
        model = self.check_model(req.model)
        ids = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        prompts = [_Prompt(ids)]
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_lengths(prompts, max_tokens, max_param)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        kind = _Kind("chat.completion", "chat.completion.chunk", "chatcmpl", req, prompts,
                     aliases={"max_tokens": max_param, "logprobs": "top_logprobs"})
        params = P.to_sampling_params(req, defaults=self.defaults, max_tokens=max_tokens, logprobs=logprobs,
                                      vocab_size=self.vocab_size, aliases=kind.aliases)
        return await self._generate(request, kind, params, model)

    def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> list[int]:
        if not self.tok.has_chat_template:
            raise bad_request("This model has no chat template: use /v1/completions.", "messages")
        msgs = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
        try:
            return self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                **(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are the client's
            raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None

    # ---- the shared generation path ----------------------------------------------------------------
    async def _generate(self, request: Request, kind: _Kind, params, model: str) -> Response:
        self.admit(len(kind.prompts))
        api_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        stream = self.aengine.stream()
        try:
            for i, p in enumerate(kind.prompts):
                await self.aengine.add(stream, f"{api_id}-{i}", i, p.ids, params, priority=kind.params.priority,
                                       cache_salt=kind.params.cache_salt)
        except ValueError as e:
            stream.abort()
            raise from_value_error(e, kind.aliases, default_param="prompt") from None
        except BaseException:
            stream.abort()
            raise
        if stream.aborted:  # by a drain that timed out while the adds were queued
            raise APIError(503, "The server is shutting down: retry on another instance.", code="shutting_down")
        ctx = _Response(self, kind, params.n, api_id, model)
        if kind.params.stream:
            return EventStream(ctx.events(stream), stream.abort)
        try:
            finals = await until_disconnect(request, ctx.collect(stream), stream.abort)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            stream.abort()  # no-op once finished
        if finals is None:  # the client went away
            return Response(status_code=499)
        return JSONResponse(ctx.body(finals))


def _raw_bytes(tok, token_id: int) -> bytes | None:
    piece = tok.convert_ids_to_tokens([token_id])[0]
    if piece is None or token_id in tok.all_special_ids:
        return None
    m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if m:  # sentencepiece byte fallback
        return bytes([int(m[1], 16)])
    inv = _inverse_byte_alphabet()
    if all(ch in inv for ch in piece):  # GPT-2 byte-level BPE
        return bytes(inv[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode()


@functools.lru_cache(maxsize=1)
def _inverse_byte_alphabet() -> dict[str, int]:
    return {ch: b for b, ch in _byte_alphabet().items()}


class _Response:
    """Shapes one API call's outputs as OpenAI choices, streamed or whole."""

    def __init__(self, serving: OpenAIServing, kind: _Kind, n: int, api_id: str, model: str):
        self.s, self.kind, self.n, self.id, self.model = serving, kind, n, api_id, model
        self.created = int(time.time())
        self.chat = kind.object == "chat.completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _echo(self, prompt_idx: int) -> str:
        p = self.kind.prompts[prompt_idx]
        if p.text is None:
            p.text = self.s.tok.decode(p.ids, skip_special_tokens=self.kind.params.skip_special_tokens)
        return p.text

    # ---- logprobs in both API shapes ---------------------------------------------------------------
    def _logprobs(self, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if lps is None:
            return None
        tt = self.s.token_text
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                return {"token": tt(tid), "logprob": max(lp, MIN_LOGPROB), "bytes": self.s.token_bytes(tid)}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                                for lp in lps]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t = tt(lp.token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(max(lp.logprob, MIN_LOGPROB))
            top: dict[str, float] = {}
            for i, v in lp.top:  # best first; tokens with the same text keep the best
                top.setdefault(tt(i), max(v, MIN_LOGPROB))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def _choice(self, index: int, text: str, logprobs: dict | None, o: CompletionOutput, *, delta: bool) -> dict:
        c: dict[str, Any] = {"index": index}
        if not self.chat:
            c["text"] = text
        elif delta:
            c["delta"] = {"content": text} if text else {}
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = logprobs
        c["finish_reason"] = o.finish_reason
        c["stop_reason"] = o.stop_reason
        return c

    def _usage(self, finals: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(p.ids) for p in self.kind.prompts)
        completion = sum(len(o.token_ids) for r in finals.values() for o in r.outputs)
        cached = sum(r.num_cached_tokens for r in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- whole ---------------------------------------------------------------------------------------
    async def collect(self, stream: RequestStream) -> dict[int, RequestOutput] | None:
        finals: dict[int, RequestOutput] = {}
        async for idx, out in stream:
            if out.finished:
                finals[idx] = out
        return finals if len(finals) == len(self.kind.prompts) else None

    def body(self, finals: dict[int, RequestOutput]) -> dict:
        choices = []
        for idx in sorted(finals):
            for o in finals[idx].outputs:
                text = (self._echo(idx) + o.text) if self.kind.echo else o.text
                choices.append(self._choice(idx * self.n + o.index, text, self._logprobs(o.logprobs), o, delta=False))
        return {**self._head(self.kind.object), "choices": choices, "usage": self._usage(finals)}

    # ---- streamed ------------------------------------------------------------------------------------
    async def events(self, stream: RequestStream):
        """One chunk per step per choice that changed; finish_reason exactly once per choice."""
        include_usage = bool(self.kind.params.stream_options and self.kind.params.stream_options.include_usage)
        head = self._head(self.kind.chunk_object)
        finals: dict[int, RequestOutput] = {}
        done: set[int] = set()
        started: set[int] = set()
        offsets: dict[int, int] = {}
        try:
            if self.chat:
                for i in range(len(self.kind.prompts) * self.n):
                    yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            async for idx, out in stream:
                if out.finished:
                    finals[idx] = out
                for o in out.outputs:
                    index = idx * self.n + o.index
                    if index in done or not (o.delta_text or o.finished or (o.delta_logprobs and o.logprobs is not None)):
                        continue
                    text = o.delta_text
                    if self.kind.echo and index not in started:
                        text = self._echo(idx) + text
                    started.add(index)
                    lps = self._logprobs(o.delta_logprobs, offsets.get(index, 0)) if o.logprobs is not None else None
                    if lps is not None and not self.chat:
                        offsets[index] = offsets.get(index, 0) + sum(map(len, lps["tokens"]))
                    if o.finished:
                        done.add(index)
                    yield sse({**head, "choices": [self._choice(index, text, lps, o, delta=True)]})
            if stream.aborted:
                return
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(finals)})
        except EngineDeadError as e:
            yield sse(APIError(503, str(e), code="engine_unavailable").body())
        finally:
            stream.abort()  # no-op once finished; frees the blocks of a stream cut short
        yield DONE


__all__ = ["OpenAIServing", "ClientDisconnect"]
