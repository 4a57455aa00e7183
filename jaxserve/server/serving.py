"""The OpenAI endpoints that generate: /v1/completions and /v1/chat/completions.

Both follow one path: parse -> prompts to token ids -> SamplingParams -> admit (503 draining,
429 queue full) -> one engine request per prompt on one RequestStream -> SSE chunks or one JSON
body. They differ only in how a prompt is built and how a choice is shaped, which `Kind` holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server import protocol as P
from jaxserve.server import tools as T
from jaxserve.server.async_engine import AsyncEngine, EngineDeadError
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.responses import Kind, Prompt, ResponseBuilder, TokenTexts
from jaxserve.server.streaming import EventStream, until_disconnect
from jaxserve.server.tool_parsers import detect_tool_parser

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing:
    def __init__(self, engine, aengine: AsyncEngine, cfg: ServerConfig, tokenizer):
        self.aengine = aengine
        self.cfg = cfg
        self.tok = tokenizer  # this thread's own copy: the engine thread uses the engine's
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.validate_prompt: Callable[[list[int]], None] = (
            engine.validate_prompt
        )  # pure: reads only limits
        self.defaults = dict(engine.loaded.generation_defaults)
        self.model_names = list(cfg.served_model_names or [engine.loaded.name])
        self.draining = False
        self.tokens = TokenTexts(tokenizer)
        self.grammar = getattr(engine, "grammar_compiler", None)  # structured outputs, if wired
        self.tool_parser = cfg.tool_call_parser or detect_tool_parser(tokenizer.chat_template)

    # ---- shared checks ---------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        too_big = APIError(
            413,
            f"The request body is larger than the limit of {limit} bytes.",
            code="body_too_large",
        )
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
            raise APIError(
                404,
                f"The model {name[:100]!r} does not exist: this server serves "
                f"{', '.join(map(repr, self.model_names))}.",
                param="model",
                code="model_not_found",
            )
        return name

    def admit(self, num_requests: int) -> None:
        if self.draining:
            raise APIError(
                503, "The server is shutting down: retry on another instance.", code="shutting_down"
            )
        reason = self.aengine.health()
        if reason is not None:
            raise APIError(503, reason, code="engine_unavailable")
        queued = self.aengine.num_queued
        if queued + num_requests > self.cfg.max_queued_requests:
            raise APIError(
                429,
                f"Too many requests waiting ({queued}, limit {self.cfg.max_queued_requests}): "
                "retry later.",
                code="queue_full",
            )

    def check_lengths(self, prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
        for p in prompts:
            try:
                self.validate_prompt(p.ids)
            except ValueError as e:
                raise from_value_error(
                    e, default_param="messages" if param == "max_completion_tokens" else "prompt"
                )
            if max_tokens is not None and len(p.ids) + max_tokens > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens, but {len(p.ids) + max_tokens} "
                    f"were requested ({len(p.ids)} in the prompt, {max_tokens} to generate): "
                    f"shorten the prompt or lower '{param}'.",
                    param,
                    code="context_length_exceeded",
                )

    # ---- /v1/completions -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await self.read_body(request))
        req.check_stream_options()
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("'suffix' is not supported.", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request(
                "'echo' with 'logprobs' needs prompt logprobs, which this server does not compute.",
                "echo",
            )
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        prompts = [
            Prompt(self.tok.encode(p), p) if isinstance(p, str) else Prompt(list(p)) for p in raw
        ]
        self.check_lengths(prompts, req.max_tokens, "max_tokens")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(
                COMPLETIONS_DEFAULT_MAX_TOKENS,
                self.max_model_len - max(len(p.ids) for p in prompts),
            )
        kind = Kind("text_completion", "text_completion", "cmpl", req, prompts, echo=req.echo)
        spec, spec_param = T.structured_spec(req)
        params = P.to_sampling_params(
            req,
            defaults=self.defaults,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            vocab_size=self.vocab_size,
            aliases={},
            structured_outputs=spec,
        )
        await T.check_grammar(self.grammar, spec, spec_param)
        return await self._generate(request, kind, params, model)

    # ---- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = P.parse(P.ChatCompletionRequest, await self.read_body(request))
        req.check_stream_options()
        model = self.check_model(req.model)
        plan = T.plan(req, self.tool_parser, self.cfg.reasoning_parser)
        ids = self.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs, plan.template_tools
        )
        prompts = [Prompt(ids)]
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        self.check_lengths(prompts, max_tokens, max_param)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        kind = Kind(
            "chat.completion",
            "chat.completion.chunk",
            "chatcmpl",
            req,
            prompts,
            aliases={"max_tokens": max_param, "logprobs": "top_logprobs"},
        )
        spec, spec_param = T.structured_spec(req, plan.tool_call)
        kind.output = plan.output_for(spec)
        params = P.to_sampling_params(
            req,
            defaults=self.defaults,
            max_tokens=max_tokens,
            logprobs=logprobs,
            vocab_size=self.vocab_size,
            aliases=kind.aliases,
            structured_outputs=spec,
        )
        if plan.skip_special_tokens is not None:
            params.skip_special_tokens = plan.skip_special_tokens
        await T.check_grammar(self.grammar, spec, spec_param)
        return await self._generate(request, kind, params, model)

    def render_chat(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        if not self.tok.has_chat_template:
            raise bad_request("This model has no chat template: use /v1/completions.", "messages")
        msgs = [T.message_dict(m, i) for i, m in enumerate(messages)]
        kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            return self.tok.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, **kw
            )
        except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are the client's
            raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None

    # ---- the shared generation path --------------------------------------------------------------
    async def _generate(self, request: Request, kind: Kind, params, model: str) -> Response:
        self.admit(len(kind.prompts))
        api_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        stream = self.aengine.stream()
        try:
            for i, p in enumerate(kind.prompts):
                await self.aengine.add(
                    stream,
                    f"{api_id}-{i}",
                    i,
                    p.ids,
                    params,
                    priority=kind.params.priority,
                    cache_salt=kind.params.cache_salt,
                )
        except ValueError as e:
            stream.abort()
            raise from_value_error(e, kind.aliases, default_param="prompt") from None
        except BaseException:
            stream.abort()
            raise
        if stream.aborted:  # by a drain that timed out while the adds were queued
            raise APIError(
                503, "The server is shutting down: retry on another instance.", code="shutting_down"
            )
        ctx = ResponseBuilder(self.tokens, kind, params.n, api_id, model)
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
