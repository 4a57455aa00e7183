"""The offline batch API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.errors import UserError
from jaxserve.outputs import RequestOutput
from jaxserve.pooling import PoolingParams, pooling_request
from jaxserve.progress import compile_progress
from jaxserve.rerank import pair_prompt
from jaxserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `LLM()` runs the embedded default model (SmolLM2-135M-Instruct). Keyword arguments are
    EngineConfig fields: max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_memory, prefix_cache, eviction, schedule, attention_backend, dtype, ...
    """

    def __init__(self, model: str | None = None, *, use_tqdm: bool = True, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        if self.engine.config.precompile:
            self.engine.precompile(compile_progress() if use_tqdm else None)
        self._next_id = 0

    def reset_prefix_cache(self) -> int:
        """Drop the cached prefixes no request holds; returns the number of blocks freed."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's behaviour: the model's generation_config.json supplies the defaults."""
        return SamplingParams(**self.engine.loaded.generation_defaults)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A list of ints counts as token ids, and so does
        vLLM's `{"prompt_token_ids": [...]}` (`{"prompt": "..."}` is text)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = [_item(p) for p in prompts]
        return self._run(items, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        items = [(None, tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)) for c in convs]
        return self._run(items, sampling_params, use_tqdm, None)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[dict],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
    ) -> np.ndarray:
        """One embedding per prompt, f32[N, D], pooled as the model's pooling config says (its
        sentence-transformers files, else last token + L2 norm); `dimensions`: the first D values
        of a Matryoshka model's vector; `normalize` overrides the model's normalisation."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        p = self.engine.pooling_config.params(dimensions, self.engine.model_config.hidden_size)
        if normalize is not None:
            p = dataclasses.replace(p, normalize=bool(normalize))
        items = [(None, list(q)) if not isinstance(q, str) else (q, None) for q in prompts]
        return np.stack(self._pooled(items, p, use_tqdm))

    def score(self, query: str, documents: Sequence[str], *, instruction: str | None = None,
              use_tqdm: bool = True) -> list[float]:
        """Qwen3-Reranker relevance of each document to the query: p(yes) in [0, 1]."""
        tok = self.engine.tokenizer
        items = [(None, pair_prompt(tok, query, d, instruction)) for d in documents]
        return [float(v[0]) for v in self._pooled(items, PoolingParams(score=True, normalize=False), use_tqdm)]

    def _pooled(self, items, p: PoolingParams, use_tqdm: bool) -> list[np.ndarray]:
        outs = self._run(items, pooling_request(p), use_tqdm, None)
        bad = next((o for o in outs if o.pooled is None), None)
        if bad is not None:
            raise RuntimeError(bad.error or f"request {bad.request_id} ended without its pooled output")
        return [o.pooled for o in outs]

    def _run(self, items, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(items)
        )
        if len(params) != len(items):
            raise UserError(f"Got {len(params)} sampling params for {len(items)} prompts: pass one, or one per prompt.")
        engine = self.engine
        ids = []
        try:
            for i, ((text, token_ids), p) in enumerate(zip(items, params)):
                rid = str(self._next_id)
                self._next_id += 1
                engine.add_request(rid, text, p, prompt_token_ids=token_ids,
                                   priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._drain(ids, use_tqdm)

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        t0 = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    out_toks += sum(len(o.delta_token_ids) for o in out.outputs)
                    if out.finished:
                        results[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        if bar is not None:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(f"in: {in_toks / dt:.0f} tok/s, out: {out_toks / dt:.0f} tok/s")
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(ids):
                    raise RuntimeError("The engine stopped with requests unfinished.")
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[r] for r in ids]


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, unit="req")


def _item(p) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt: a string, token ids, or vLLM's prompt dict."""
    if isinstance(p, str):
        return p, None
    if isinstance(p, dict):
        if set(p) - {"prompt", "prompt_token_ids"} or len(p) != 1:
            raise UserError(f"A prompt dict has one key, 'prompt' or 'prompt_token_ids'; got {sorted(p)}.",
                            param="prompt")
        return p.get("prompt"), (list(p["prompt_token_ids"]) if "prompt_token_ids" in p else None)
    return None, list(p)
