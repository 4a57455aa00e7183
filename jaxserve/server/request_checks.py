"""The checks every generating endpoint makes before the engine sees a request (`RequestChecks`,
the base of serving.OpenAIServing): the body's type and size, the model name, token ids, prompt
lengths against the context and the KV cache, admission (503 draining, 429 queue full, 400 too
many sequences), and prompt truncation and tokenizing, off the event loop for long texts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from starlette.requests import Request

from jaxserve.server import protocol as P
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.offload import run_bounded
from jaxserve.server.responses import Prompt

INLINE_ENCODE_CHARS = 4096  # shorter prompts are tokenized on the event loop
INLINE_PARSE_BYTES = 64 << 10  # larger bodies (up to --max-body-bytes) are parsed on a worker thread

SHUTTING_DOWN = "The server is shutting down: retry on another instance."


def served_names(model: str, cfg: ServerConfig) -> list[str]:
    """The names /v1/models shows: --served-model-name, else the model's, never a local path."""
    if cfg.served_model_names:
        return list(cfg.served_model_names)
    return [os.path.basename(model.rstrip("/\\")) or model]


async def parse(model: type, body: bytes):
    """P.parse, on a worker thread for a large body (a 60,000-message chat took ~0.5 s)."""
    if len(body) <= INLINE_PARSE_BYTES:
        return P.parse(model, body)
    return await asyncio.to_thread(P.parse, model, body)


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="shutting_down")


class RequestChecks:
    """What every endpoint checks before the engine sees a request, on the state it needs: the
    body's type and size, the model name, token ids, prompt lengths against the context and the
    KV cache, admission (draining, engine health, queue), and prompt truncation and tokenizing."""

    def __init__(self, engine, aengine: AsyncEngine, cfg: ServerConfig, tokenizer):
        self.aengine = aengine
        self.cfg = cfg
        self.tok = tokenizer  # this thread's own copy: the engine thread uses the engine's
        self.max_model_len = engine.max_model_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.vocab_size = engine.model_config.vocab_size
        self.validate_prompt: Callable[[list[int]], None] = (
            engine.validate_prompt
        )  # pure: reads only limits
        self.model_names = served_names(engine.loaded.name, cfg)
        # Clients may also send the --model argument itself (vLLM's default name), path or not.
        self.accepted_names = {*self.model_names, engine.loaded.name}
        self.draining = False
        # No token covers more characters than the longest vocabulary piece, so a text longer
        # than max_model_len * that is too long without tokenizing it.
        longest = max((len(p) for p in tokenizer.hf.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.longest_token_chars = max(longest, 1)

    async def read_body(self, request: Request) -> bytes:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(
                415,
                f"Unsupported Content-Type {ctype[:60] or '(none)'!r}: send the body as JSON "
                "with 'Content-Type: application/json'.",
                code="unsupported_media_type",
            )
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
        if name not in self.accepted_names:
            raise APIError(
                404,
                f"The model {name[:100]!r} does not exist: this server serves "
                f"{', '.join(map(repr, self.model_names))}.",
                param="model",
                code="model_not_found",
            )
        return name

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """vLLM's wording ('... out of vocabulary'), which clients match on."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} in '{param}' is out of vocabulary (valid ids: "
                f"0..{self.vocab_size - 1}).",
                param,
            )

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"The prompt has {num_chars} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold: shorten it.",
                param,
                code="context_length_exceeded",
            )

    def admit(self, num_seqs: int, num_requests: int) -> None:
        if num_seqs > self.cfg.max_seqs_per_request:
            raise bad_request(
                f"The request asks for {num_seqs} sequences (prompts x n), more than this "
                f"server's limit of {self.cfg.max_seqs_per_request}: split it or lower 'n'.",
                "n",
                code="too_many_sequences",
            )
        if self.draining:
            raise shutting_down()
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
        prompt_param = "messages" if param == "max_completion_tokens" else "prompt"
        for p in prompts:
            if not p.ids:
                raise bad_request(
                    "The prompt cannot be empty: send at least one token.", prompt_param
                )
            self.check_token_ids(p.ids, prompt_param)
            self.validate_prompt(p.ids)
            if max_tokens is None:
                continue
            total = len(p.ids) + max_tokens
            if total > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens, but "
                    f"{total} were requested ({len(p.ids)} in the prompt, {max_tokens} to "
                    f"generate): shorten the prompt or lower '{param}'.",
                    param,
                    code="context_length_exceeded",
                )
            if total > self.kv_capacity_tokens:  # it could never finish: not a retry-later
                raise bad_request(
                    f"{total} tokens ({len(p.ids)} in the prompt, {max_tokens} to generate) do "
                    f"not fit this server's whole KV cache of {self.kv_capacity_tokens} tokens: "
                    f"shorten the prompt or lower '{param}'.",
                    param,
                    code="context_length_exceeded",
                )

    def truncation_keep(self, req: P.SamplingRequest, max_tokens: int | None) -> tuple[int, str] | None:
        """(tokens kept, side) of truncate_prompt_tokens; a 400 past max_model_len (vLLM's rule)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return None
        if k > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                f"({self.max_model_len}): select a smaller truncation size.", "truncate_prompt_tokens")
        if k == -1:
            k = max(self.max_model_len - (max_tokens or 1), 0)
        return k, req.truncation_side

    def truncate(self, ids: list[int], req: P.SamplingRequest, max_tokens: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens; -1 keeps as much as leaves room for max_tokens."""
        k = req.truncate_prompt_tokens
        if k == -1:
            k = self.max_model_len - (max_tokens or 1)
        if k is None or len(ids) <= k:
            return ids
        if k == 0:
            return []
        return ids[-k:] if req.truncation_side == "left" else ids[:k]

    async def encode(
        self, text: str, param: str, truncating: bool = False, add_special_tokens: bool = True,
        keep: tuple[int, str] | None = None,
    ) -> list[int]:
        """Token ids of a prompt; only long texts pay for a thread (short ones take microseconds).
        `keep` = (k, side): only k tokens at that end are kept (truncate_prompt_tokens), so only
        the characters k tokens can span are tokenized: the work is bounded by k, not by the
        text (the far edge of the cut may split a word differently; the kept end is exact)."""
        if keep is not None:
            k, side = keep
            span = (k + 1) * self.longest_token_chars + 64
            if len(text) > span:
                text = text[-span:] if side == "left" else text[:span]
        elif not truncating:
            self.check_chars(len(text), param)

        def encode() -> list[int]:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)

        if len(text) <= INLINE_ENCODE_CHARS:
            return encode()
        return await run_bounded(encode, self.cfg.render_timeout, "Tokenizing the prompt", param)
