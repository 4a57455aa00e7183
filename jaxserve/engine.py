"""LLMEngine: requests in, one scheduled step at a time, outputs out.

    add_request -> [schedule -> build padded batch -> runner (forward + sample) -> update]* -> outputs

The engine owns what the host must do around a step: tokenizing, per-request seeds, incremental
detokenization, stop conditions, logprobs, and fanning out n > 1 into sibling sequences that share
the prompt's cached blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.runtime.input_batch import build_sampling_arrays, build_step_inputs
from jaxserve.runtime.sampler import SamplingMode
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve")


@dataclass(eq=False)
class _Seq:
    """One completion (choice) of a request; its core Request is what the scheduler sees."""

    group_id: str
    req: Request
    index: int
    seed: int
    detok: IncrementalDetokenizer
    out: CompletionOutput


@dataclass(eq=False)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq] = field(default_factory=list)
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        from jaxserve.model.loader import load_model
        from jaxserve.runtime import runner as rt
        from jaxserve.runtime.attention import default_backend as default_attention_backend

        config = config or EngineConfig(**kwargs)
        self.config = config
        if config.compilation_cache:
            rt.enable_compilation_cache()
        dtype = config.dtype or rt.default_dtype()
        self.loaded = load_model(config.model)
        self.model_config = mc = self.loaded.config
        kv_dtype = config.kv_cache_dtype or rt.default_kv_cache_dtype(dtype, mc.checkpoint_dtype)
        self.tokenizer = Tokenizer.from_pretrained(self.loaded.path)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.num_blocks = config.num_blocks or self._blocks_from_budget(kv_dtype)
        self.runner = rt.ModelRunner(
            mc,
            self.loaded.params,
            rt.RunnerConfig(
                block_size=config.block_size,
                num_blocks=self.num_blocks,
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                attention_backend=config.attention_backend or default_attention_backend(dtype, kv_dtype),
                dtype=dtype,
                kv_cache_dtype=kv_dtype,
                tensor_parallel_size=config.tensor_parallel_size,
            ),
        )
        self.loaded.params = None  # host copy no longer needed
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                prefix_cache=config.prefix_cache,
                eviction=config.eviction,
                policy=config.schedule,
                prefill_first=config.prefill_first,
                admission=config.admission,
            )
        )
        self.eos_token_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, _Seq] = {}  # core request id -> seq
        self.counters = dict(steps=0, prompt_tokens=0, generation_tokens=0, computed_tokens=0)
        cap_tokens = (self.num_blocks - 1) * config.block_size
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len=%d: %.2f",
            self.num_blocks - 1, config.block_size, cap_tokens,
            self.num_blocks * rt.kv_bytes_per_block(mc, config.block_size, kv_dtype) / 2**20, kv_dtype,
            self.max_model_len, cap_tokens / self.max_model_len,
        )
        self.kv_capacity_tokens = cap_tokens

    def _blocks_from_budget(self, dtype: str) -> int:
        from jaxserve.runtime import runner as rt

        budget = rt.kv_memory_budget(self.config.kv_cache_memory, self.config.memory_fraction, 0)
        per_block = rt.kv_bytes_per_block(self.model_config, self.config.block_size, dtype,
                                          self.config.tensor_parallel_size)  # per device
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(
                f"The KV cache budget of {budget / 2**20:.1f} MiB holds no block of {per_block / 2**20:.2f} MiB: "
                "raise --kv-cache-memory or --memory-fraction."
            )
        return int(blocks)

    def precompile(self, progress=None) -> float:
        return self.runner.precompile(progress)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (a message for the user) if it can never run."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("The prompt must be a string or a list of token ids.")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        for t in params.stop_token_ids + list((params.logit_bias or {}).keys()):
            if t >= self.model_config.vocab_size:
                raise ValueError(f"Token id {t} is outside the vocabulary (size {self.model_config.vocab_size}).")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.time() if arrival_time is None else arrival_time
        group = _Group(request_id, prompt, prompt_token_ids, params, metrics=RequestMetrics(arrival_time=now))
        reqs = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = (params.seed + i) if params.seed is not None else self._rng.getrandbits(32)
            req = Request(rid, list(prompt_token_ids), max_tokens, arrival_time=now, priority=priority, cache_salt=cache_salt)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            )
            out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            group.seqs.append(_Seq(request_id, req, i, seed, detok, out))
            reqs.append(req)
        for req in reqs:
            self.scheduler.add_request(req)  # raises for requests the cache can never hold
        self._groups[request_id] = group
        for s in group.seqs:
            self._seqs[s.req.request_id] = s
        self.counters["prompt_tokens"] += len(prompt_token_ids)

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("The prompt is empty: send at least one token.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"Prompt token id {bad} is outside the vocabulary (0..{vocab - 1}).")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "shorten the prompt or start the engine with a larger --max-model-len."
            )

    def abort_request(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.seqs:
            self._seqs.pop(s.req.request_id, None)
            if not s.req.is_finished:
                self.scheduler.abort_request(s.req.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: dict[str, _Group] = {}
        for req in sched.finished:  # ended by the scheduler (outgrew the whole KV cache)
            seq = self._seqs.get(req.request_id)
            if seq is not None and seq.group_id in self._groups:
                self._finish(self._groups[seq.group_id], seq, req.status, None)
                touched[seq.group_id] = self._groups[seq.group_id]
        if not sched.scheduled:
            return [self._output(g) for g in touched.values()]
        now = time.time()
        # Decode rows (one new token) first: the XLA attention takes them in a loop of their own.
        scheduled = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        rows = [(s.request.token_ids, s.start, s.num_new_tokens, s.request.block_ids) for s in scheduled]
        num_tokens = sched.num_batched_tokens
        t, s_bucket = self.runner.bucket_for(num_tokens, len(rows))
        inputs = build_step_inputs(
            rows, t_bucket=t, s_bucket=s_bucket, block_size=self.config.block_size, max_blocks=self.runner.max_blocks
        )
        seqs = [self._seqs[s.request.request_id] for s in scheduled]
        tensors, mode = self._sampling_inputs(seqs, s_bucket)
        result = self.runner.execute(inputs, t, s_bucket, tensors, SamplingMode(**mode))
        tokens, chosen_lp, top_ids, top_lps = self.runner.fetch(result)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += num_tokens

        sampled = {}
        for i, sr in enumerate(scheduled):
            if sr.samples:
                sampled[sr.request.request_id] = int(tokens[i])
        self.scheduler.update_from_output(sched, sampled)

        for i, sr in enumerate(scheduled):
            seq = seqs[i]
            group = self._groups.get(seq.group_id)
            if group is None:
                continue
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if not sr.samples:
                continue
            lp = None
            if seq.out.logprobs is not None:
                n = group.params.logprobs
                lp = TokenLogprob(int(tokens[i]), float(chosen_lp[i]),
                                  [(int(a), float(b)) for a, b in zip(top_ids[i, :n], top_lps[i, :n])])
            self._append(group, seq, int(tokens[i]), lp)
            touched[group.request_id] = group
        return [self._output(g) for g in touched.values()]

    def _sampling_inputs(self, seqs: list[_Seq], s_bucket: int):
        params, seeds, steps, banned, prompts, outs = [], [], [], [], [], []
        for seq in seqs:
            p = self._groups[seq.group_id].params
            req = seq.req
            params.append(p)
            seeds.append(seq.seed)
            steps.append(req.num_output_tokens)
            ban = []
            if req.num_output_tokens < p.min_tokens:
                ban = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
            banned.append(ban)
            prompts.append(req.prompt_token_ids if p.uses_penalties else [])
            outs.append(req.output_token_ids if p.uses_penalties else [])
        return build_sampling_arrays(params, seeds, steps, banned, prompts, outs, s_bucket)

    def _append(self, group: _Group, seq: _Seq, token: int, lp: TokenLogprob | None) -> None:
        """Record a sampled token (already appended to the core request) and check stop conditions."""
        p, req, out = group.params, seq.req, seq.out
        now = time.time()
        m = group.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        self.counters["generation_tokens"] += 1
        out.token_ids.append(token)
        out.delta_token_ids.append(token)
        if lp is not None:
            out.logprobs.append(lp)
            out.delta_logprobs.append(lp)
            out.cumulative_logprob += lp.logprob
        status, stop_reason = None, None
        n_out = req.num_output_tokens
        # EOS and stop tokens cannot be sampled before min_tokens (they are banned on device).
        if token in self.eos_token_ids and not p.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        if status is None:
            delta = seq.detok.add(token)
            out.delta_text += delta
            if seq.detok.stopped and n_out >= p.min_tokens:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, seq.detok.stop_str
        if status is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(group, seq, status, stop_reason)
        else:
            out.text = seq.detok.text

    def _finish(self, group: _Group, seq: _Seq, status: RequestStatus, stop_reason) -> None:
        out = seq.out
        if not seq.detok.stopped:
            out.delta_text += seq.detok.flush()
        out.text = seq.detok.text
        out.finish_reason = status.finish_reason
        out.stop_reason = stop_reason
        if not seq.req.is_finished:
            self.scheduler.finish_request(seq.req, status)
        if group.finished:
            group.metrics.finished_time = time.time()

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for s in group.seqs:
            o = s.out
            outs.append(CompletionOutput(
                index=o.index, text=o.text, token_ids=list(o.token_ids), cumulative_logprob=o.cumulative_logprob,
                logprobs=list(o.logprobs) if o.logprobs is not None else None, finish_reason=o.finish_reason,
                stop_reason=o.stop_reason, delta_text=o.delta_text, delta_token_ids=o.delta_token_ids,
                delta_logprobs=o.delta_logprobs,
            ))
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                self._seqs.pop(s.req.request_id, None)
        cached = max((s.req.num_cached_tokens for s in group.seqs), default=0)
        # A snapshot of the metrics: the engine keeps updating its own copy while consumers (the
        # server's event loop) may read this output a step later.
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             max(cached, 0), dataclasses.replace(group.metrics))

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes no running request uses (as vLLM's reset_prefix_cache), e.g.
        between benchmark runs; returns how many blocks went back to the free list."""
        return self.scheduler.kv.reset_cache()

    # ---- introspection ----------------------------------------------------------------------------
    def get_stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats.update(self.counters)
        stats.update(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                     num_compiles=self.runner.num_compiles)
        return stats

