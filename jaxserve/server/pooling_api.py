"""Embeddings and rerank: POST /v1/embeddings (OpenAI's shape), /v1/rerank (Cohere's and Jina's)
and /v1/score (vLLM's).

Each input becomes one pooling request (jaxserve.pooling) on the same async engine as generation,
so limits, API key, request ids, metrics, the queue bound and disconnects (an abort of every
request of the call) are those of chat completions; errors are OpenAI's shape, naming the field.
Rerank and score judge each (query, document) pair the Qwen3-Reranker way (jaxserve.rerank).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.errors import UserError
from jaxserve.outputs import RequestOutput
from jaxserve.pooling import PoolingParams, pooling_request
from jaxserve.rerank import PREFIX, SUFFIX, pair_text
from jaxserve.server import protocol as P
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.request_checks import shutting_down
from jaxserve.server.serving import OpenAIServing


class _Strict(BaseModel):
    # Every field that would change the answer is either served or a 400 naming it.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, not used


class Document(_Strict):
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[str | Document]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    instruction: str | None = None  # Qwen3-Reranker's <Instruct> (default: web search)


class ScoreRequest(_Strict):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None


class PoolingAPI:
    def __init__(self, serving: OpenAIServing, engine):
        self.serving = serving
        self.config = engine.pooling_config
        self.hidden_size = engine.model_config.hidden_size
        self.score_error = engine.score_head if isinstance(engine.score_head, str) else None
        tok = serving.tok
        self.prefix = tok.encode(PREFIX, add_special_tokens=False)
        self.suffix = tok.encode(SUFFIX, add_special_tokens=False)

    # ---- routes ------------------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        req = P.parse(EmbeddingRequest, await self.serving.read_body(request))
        model = self.serving.check_model(req.model)
        prompts = await self._embedding_inputs(req.input)
        params = self.config.params(req.dimensions, self.hidden_size)
        outs = await self._run(request, prompts, params, "embd", "input")
        data = [{"object": "embedding", "index": i, "embedding": _encode(o.pooled, req.encoding_format)}
                for i, o in enumerate(outs)]
        n = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def rerank(self, request: Request) -> Response:
        req = P.parse(RerankRequest, await self.serving.read_body(request))
        model = self.serving.check_model(req.model)
        if not req.documents:
            raise bad_request("'documents' is empty: send at least one document.", "documents")
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        prompts = [await self._pair(req.query, d, req.instruction, "documents") for d in docs]
        scores = await self._scores(request, prompts, "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        n = sum(len(p) for p in prompts)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def score(self, request: Request) -> Response:
        req = P.parse(ScoreRequest, await self.serving.read_body(request))
        model = self.serving.check_model(req.model)
        left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        for name, texts in (("text_1", left), ("text_2", right)):
            if not texts:
                raise bad_request(f"'{name}' is empty: send at least one text.", name)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise bad_request(f"'text_1' has {len(left)} texts and 'text_2' {len(right)}: send one "
                              "'text_1', or as many as 'text_2' (scored pairwise).", "text_2")
        prompts = [await self._pair(q, d, req.instruction, "text_2") for q, d in zip(left, right)]
        scores = await self._scores(request, prompts, "text_2")
        n = sum(len(p) for p in prompts)
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model,
                             "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    # ---- shared --------------------------------------------------------------------------------------
    async def _embedding_inputs(self, value) -> list[list[int]]:
        if isinstance(value, str):
            value = [value]
        if not value:
            raise bad_request("'input' is empty: send a string, a list of strings or token ids.", "input")
        if isinstance(value[0], int):
            value = [value]
        prompts = []
        for item in value:
            ids = await self.serving.encode(item, "input") if isinstance(item, str) else list(item)
            if not ids:
                raise bad_request("An 'input' is empty: send at least one token.", "input")
            prompts.append(ids)
        return prompts

    async def _pair(self, query: str, document: str, instruction: str | None, param: str) -> list[int]:
        body = await self.serving.encode(pair_text(query, document, instruction), param, add_special_tokens=False)
        return self.prefix + body + self.suffix

    async def _scores(self, request: Request, prompts: list[list[int]], param: str) -> list[float]:
        if self.score_error is not None:
            raise bad_request(self.score_error, "model", code="model_not_supported")
        outs = await self._run(request, prompts, PoolingParams(normalize=False, score=True), "score", param)
        return [float(o.pooled[0]) for o in outs]

    async def _run(self, request: Request, prompts: list[list[int]], params: PoolingParams, prefix: str,
                   param: str) -> list[RequestOutput]:
        """One pooling request per prompt, on one stream; their finished outputs in order."""
        s = self.serving
        for ids in prompts:
            s.check_token_ids(ids, param)
            try:
                s.validate_prompt(ids)
            except UserError as e:  # the engine names its own 'prompt'
                raise bad_request(str(e), param, code=e.code) from None
            if len(ids) + 1 > s.kv_capacity_tokens:
                raise bad_request(f"An input of {len(ids)} tokens does not fit this server's whole KV cache of "
                                  f"{s.kv_capacity_tokens} tokens: shorten it.", param,
                                  code="context_length_exceeded")
        s.admit(len(prompts), len(prompts))
        api_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = s.aengine.stream()
        sp = pooling_request(params)
        try:
            for i, ids in enumerate(prompts):
                await s.aengine.add(stream, f"{api_id}-{i}", i, ids, sp)
        except BaseException:
            stream.abort()
            raise
        if stream.aborted:
            raise shutting_down()
        finals: list[Any] = [None] * len(prompts)

        async def collect():
            async for i, out in stream:
                if out.finished:
                    finals[i] = out
            return finals if all(o is not None for o in finals) else None

        outs = await s.wait(request, stream, collect())
        bad = next((o for o in outs if o.pooled is None), None)
        if bad is not None:
            raise APIError(500, bad.error or "The request ended without its result.", code="request_failed")
        return outs


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode()
    return vec.tolist()
