"""The OpenAI endpoints that generate: /v1/completions, /v1/chat/completions and /invocations.

Both follow one path: read (415 wrong type, 413 too big) -> parse -> prompts to token ids, off the
event loop with a time bound -> SamplingParams -> admit (503 draining, 429 queue full, 400 too many
sequences) -> one engine request per prompt on one RequestStream -> SSE chunks or one JSON body.
They differ only in how a prompt is built and how a choice is shaped, which `Kind` holds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from jaxserve.sampling_params import SamplingParams
from jaxserve.server import protocol as P
from jaxserve.server import tools as T
from jaxserve.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from jaxserve.server.chat_template import ChatTemplate
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.request_checks import RequestChecks, parse, shutting_down
from jaxserve.server.responses import Kind, Prompt, ResponseBuilder, TokenTexts
from jaxserve.server.streaming import EventStream, dumps_yielding, until_disconnect
from jaxserve.server.tool_parsers import detect_tool_parser
from jaxserve.structured import StructuredOutputs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing(RequestChecks):
    def __init__(self, engine, aengine: AsyncEngine, cfg: ServerConfig, tokenizer):
        super().__init__(engine, aengine, cfg, tokenizer)
        self.defaults = dict(engine.loaded.generation_defaults)
        self.tokens = TokenTexts(tokenizer)
        self.chat_template = ChatTemplate(tokenizer, cfg, self.check_chars)
        self.grammar = getattr(engine, "grammar_compiler", None)  # structured outputs, if wired
        self.tool_parser = cfg.tool_call_parser or detect_tool_parser(tokenizer.chat_template)

    # ---- /v1/completions -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._completions(request, await self.read_body(request))

    async def _completions(self, request: Request, body: bytes) -> Response:
        req = await parse(P.CompletionRequest, body)
        req.check()
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("'suffix' is not supported.", "suffix")
        # echo with max_tokens 0 (lm-eval's log-likelihood request): score the prompt and return
        # only it; the engine samples one token (as vLLM does), which is dropped.
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("'max_tokens' must be at least 1 (0 is allowed only with 'echo').",
                              "max_tokens")
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        self.admit(len(raw) * req.n, len(raw))
        truncating = req.truncate_prompt_tokens is not None
        keep = self.truncation_keep(req, req.max_tokens)
        prompts = []
        for p in raw:
            if isinstance(p, str):
                ids = await self.encode(p, "prompt", truncating, keep=keep)
                prompts.append(
                    Prompt(self.truncate(ids, req, req.max_tokens), None if truncating else p)
                )
            else:
                prompts.append(Prompt(self.truncate(list(p), req, req.max_tokens)))
        self.check_lengths(prompts, req.max_tokens, "max_tokens")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(
                COMPLETIONS_DEFAULT_MAX_TOKENS,
                self.max_model_len - max(len(p.ids) for p in prompts),
            )
        kind = Kind("text_completion", "text_completion", "cmpl", req, prompts, echo=req.echo,
                    echo_only=echo_only)
        spec, spec_param = T.structured_spec(req)
        params = self.sampling_params(req, 1 if echo_only else max_tokens, req.logprobs, {}, spec,
                                      prompt_logprobs=self.prompt_logprobs(req, req.echo))
        await T.check_grammar(self.grammar, spec, spec_param)
        return await self._generate(request, kind, params, model)

    # ---- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._chat(request, await self.read_body(request))

    async def _chat(self, request: Request, body: bytes) -> Response:
        kind, params, model = await self.plan_chat(await parse(P.ChatCompletionRequest, body))
        return await self._generate(request, kind, params, model)

    async def plan_chat(self, req: P.ChatCompletionRequest) -> tuple[Kind, SamplingParams, str]:
        """A chat request as the engine runs it: its prompt, output parser and SamplingParams.
        The other chat-shaped APIs (chat_bridge.py) come through here too."""
        req.check()
        model = self.check_model(req.model)
        self.admit(req.n, 1)
        self.truncation_keep(req, None)  # a 400 before the template runs
        plan = T.plan(req, self.tool_parser, self.cfg.reasoning_parser)
        ids = await self.chat_template.render(
            req.messages,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            chat_template=req.chat_template,
            continue_final_message=req.continue_final_message,
            tools=plan.template_tools,
        )
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        prompts = [Prompt(self.truncate(ids, req, max_tokens))]
        self.check_lengths(prompts, max_tokens, max_param)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        if req.logprob_token_ids is not None and not req.logprobs:
            raise bad_request("'logprob_token_ids' needs 'logprobs' set to true.", "logprob_token_ids")
        default = None if req.logprob_token_ids is not None else 0  # named ids: their count
        logprobs = (req.top_logprobs if req.top_logprobs is not None else default) if req.logprobs else None
        kind = Kind(
            "chat.completion",
            "chat.completion.chunk",
            "chatcmpl",
            req,
            prompts,
            aliases={"max_tokens": max_param, "logprobs": "top_logprobs"},
            chat_echo=self.chat_echo(req),
        )
        spec, spec_param = T.structured_spec(req, plan.tool_call)
        kind.output = plan.output_for(spec)
        params = self.sampling_params(req, max_tokens, logprobs, kind.aliases, spec,
                                      prompt_logprobs=self.prompt_logprobs(req, False))
        if plan.skip_special_tokens is not None:
            params.skip_special_tokens = plan.skip_special_tokens
        await T.check_grammar(self.grammar, spec, spec_param)
        return kind, params, model

    @staticmethod
    def chat_echo(req: P.ChatCompletionRequest) -> str:
        """vLLM's `echo` on chat: the last message's text, when its role is the reply's (the
        assistant's after a generation prompt, else the last message's own)."""
        if not req.echo:
            return ""
        last = req.messages[-1]
        if req.add_generation_prompt and last.role != "assistant":
            return ""
        if isinstance(last.content, list):
            return "\n".join(p.text or "" for p in last.content if p.type == "text")
        return last.content or ""

    def sampling_params(
        self,
        req: P.SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        aliases: dict,
        structured_outputs: StructuredOutputs | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        for name in ("logit_bias", "stop_token_ids"):
            self.check_token_ids([int(t) for t in getattr(req, name) or ()], name)
        return P.to_sampling_params(
            req,
            defaults=self.defaults,
            max_tokens=max_tokens,
            logprobs=logprobs,
            vocab_size=self.vocab_size,
            aliases=aliases,
            structured_outputs=structured_outputs,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def prompt_logprobs(req: P.SamplingRequest, echo: bool) -> int | None:
        """Top-N for the prompt's tokens: vLLM's `prompt_logprobs`, and on completions `echo`
        with `logprobs` (the echoed prompt carries its logprobs, as OpenAI's legacy API did)."""
        n = req.prompt_logprobs
        if echo and getattr(req, "logprobs", None) is not None:
            n = max(n or 0, req.logprobs)
        return n

    # ---- /invocations (SageMaker) ----------------------------------------------------------------
    async def invocations(self, request: Request) -> Response:
        """SageMaker's route: a chat body (with 'messages') or a completions body."""
        body = await self.read_body(request)
        try:
            is_chat = isinstance(doc := json.loads(body), dict) and "messages" in doc
        except (ValueError, RecursionError):
            is_chat = False  # the typed parse below names the JSON error (or its depth)
        return await (self._chat if is_chat else self._completions)(request, body)

    # ---- the shared generation path --------------------------------------------------------------
    async def _generate(self, request: Request, kind: Kind, params, model: str) -> Response:
        api_id, stream = await self.submit(kind, params)
        ctx = ResponseBuilder(self.tokens, kind, params.n, api_id, model)
        if kind.params.stream:
            return EventStream(ctx.events(stream), stream.abort)
        finals = await self.wait(request, stream, ctx.collect(stream))
        if params.prompt_logprobs is not None:
            # prompt tokens x top-N entries (up to max_model_len x 21), built and encoded on a
            # worker thread: the event loop keeps answering (/health) meanwhile
            def encoded() -> Response:
                return Response(dumps_yielding(ctx.body(finals)).encode(), media_type="application/json")

            return await asyncio.to_thread(encoded)
        return JSONResponse(ctx.body(finals))

    async def submit(self, kind: Kind, params, id_prefix: str | None = None
                     ) -> tuple[str, RequestStream]:
        """Admit the call and add one engine request per prompt, all on one RequestStream."""
        self.admit(len(kind.prompts) * params.n, len(kind.prompts))
        api_id = f"{id_prefix or kind.id_prefix}-{uuid.uuid4().hex}"
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
        except BaseException:
            stream.abort()
            raise
        if stream.aborted:  # by a drain that timed out while the adds were queued
            raise shutting_down()
        return api_id, stream

    async def wait(self, request: Request, stream: RequestStream, collect: Awaitable):
        """`collect`'s result (the finished outputs of a non-streamed call); a client that leaves
        first aborts the work (ClientDisconnect: a 499), a shutdown that aborts it is a 503."""
        gone = []

        def client_gone() -> None:
            gone.append(True)
            stream.abort()

        try:
            finals = await until_disconnect(request, collect, client_gone)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), code="request_failed") from None
        finally:
            stream.abort()  # no-op once finished
        if finals is None:
            if gone:
                raise ClientDisconnect()  # nobody is listening: 499, nginx's code for it
            raise shutting_down()  # aborted by the shutdown timeout
        return finals
