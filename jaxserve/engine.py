"""LLMEngine: requests in, one scheduled step at a time, outputs out.

    add_request -> [schedule -> build padded batch -> runner (forward + sample) -> update]* -> outputs

The engine owns what the host must do around a step: tokenizing, per-request seeds, grammars,
building and dispatching the batch with one step in flight, reading tokens back, and fanning out
n > 1 into sibling sequences that share the prompt's cached blocks. What a token does to a
request's output (detokenization, stop strings, logprobs) is in sequence.py.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import numpy as np

from jaxserve import limits
from jaxserve.config import EngineConfig
from jaxserve.core.batch import BucketKey, RowSpec, Sampling
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.errors import UserError
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.pooling import Pooler, PoolingConfig, score_head
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve")


@dataclass(eq=False)
class _Inflight:
    """A dispatched step whose tokens the host has not read yet."""

    sched: SchedulerOutput
    seqs: list[Seq]  # per row
    result: object  # runner.StepResult (device arrays)
    key: BucketKey
    want_logprobs: bool
    needs_tokens: bool  # a row's sampling needs its last token's value (penalties, grammars)
    row_of: dict[str, int]  # request id -> logits row, for rows that sample
    verifying: dict[str, tuple[int, int]]  # request id -> (first logits row, drafts) of verifying rows
    scored: list[tuple[int, int, int, int]]  # prompt logprobs: (row, first logits row, position, count)
    pooled: list[tuple[int, list[int], list[int]]] = ()  # pooling: (row, logits rows, their positions)


class LLMEngine:
    supports_structured_outputs = True  # grammars are applied to the logits (tests key on this)

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        from jaxserve.model.loader import load_model
        from jaxserve.runtime import memory
        from jaxserve.runtime import runner as rt

        config = config or EngineConfig(**kwargs)
        self.config = config
        memory.size_gpu_pool(config.gpu_memory_utilization)  # before jax starts its GPU backend
        if config.compilation_cache:
            rt.enable_compilation_cache()
        dtype = config.dtype or rt.default_dtype()
        self.loaded = load_model(config.model, quantization=config.quantization)
        self.model_config = mc = self.loaded.config
        kv_dtype = config.kv_cache_dtype or rt.default_kv_cache_dtype(dtype, mc.checkpoint_dtype)
        self.tokenizer = Tokenizer.from_pretrained(self.loaded.path)
        self.pooling_config = PoolingConfig.from_model(self.loaded.path)
        # rerank / score: the LM-head columns of the two score tokens, or why there are none
        self.score_head = score_head(self.loaded.params, mc, self.tokenizer, config.score_tokens)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # On an accelerator the KV cache is sized after the weights are placed and the largest
        # step is compiled (as vLLM and SGLang do); with an explicit budget, or on CPU, before.
        size_on_device = config.num_blocks is None and config.kv_cache_memory is None and memory.has_device_stats()
        self.num_blocks = config.num_blocks or (2 if size_on_device else self._blocks_from_budget(kv_dtype))
        self.runner = rt.ModelRunner(
            mc,
            self.loaded.params,
            rt.RunnerConfig(
                block_size=config.block_size,
                num_blocks=self.num_blocks,
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                attention_backend=config.attention_backend,
                dtype=dtype,
                kv_cache_dtype=kv_dtype,
                tensor_parallel_size=config.tensor_parallel_size,
                quantization=config.quantization,
                enable_expert_parallel=config.enable_expert_parallel,
            ),
        )
        self.loaded.params = None  # host copy no longer needed
        if size_on_device:
            self.num_blocks = self._plan_device_memory(kv_dtype)
        self.speculator = None
        self.drafter = None  # the draft method's model: it mirrors the target's steps (always synchronous)
        if config.speculative is not None:
            from jaxserve.spec.speculator import Speculator

            if config.speculative.method == "draft":
                from jaxserve.spec.draft import DraftModel

                self.drafter = DraftModel(config.speculative.model, self.runner.cfg, self.num_blocks, mc.vocab_size)
            self.speculator = Speculator(config.speculative, self.drafter)
        self.scheduler = Scheduler(config.scheduler_config(
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            max_num_logit_rows=self.runner.builder.s_max))
        self.eos_token_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, Group] = {}
        self._seqs: dict[str, Seq] = {}  # core request id -> seq
        self._inflight: _Inflight | None = None  # the dispatched step not yet read
        self.counters = dict(steps=0, prompt_tokens=0, generation_tokens=0, computed_tokens=0)
        # Host time in step() other than waiting for the device, and that wait (bench/host_overhead.py).
        # dispatch_busy / dispatch_idle: steps dispatched while the step before still ran on the
        # device (their host time was hidden) / onto an idle device (bench host_overhead)
        self.timing = dict(host_s=0.0, device_wait_s=0.0, steps=0, dispatch_busy=0, dispatch_idle=0)
        cap_tokens = (self.num_blocks - 1) * config.block_size
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len=%d: %.2f",
            self.num_blocks - 1, config.block_size, cap_tokens,
            self.num_blocks * rt.kv_bytes_per_block(mc, config.block_size, kv_dtype,
                                                     layout=self.runner.backend.kv_layout) / 2**20, kv_dtype,
            self.max_model_len, cap_tokens / self.max_model_len,
        )
        self.kv_capacity_tokens = cap_tokens
        from jaxserve.structured.compiler import GrammarCompiler
        from jaxserve.structured.matcher import BitmaskFiller

        # Structured outputs: grammars compile on the compiler's threads, cached by spec (its
        # tokenizer view is built on first use, so start-up does not pay for it).
        self.grammar_compiler = GrammarCompiler.for_tokenizer(
            self.tokenizer, mc.vocab_size, eos_token_ids=sorted(self.eos_token_ids))
        self._bitmask_filler = BitmaskFiller()
        self._waiting_grammar: list[tuple[Group, object]] = []  # (group, Future) until compiled
        self._failed: dict[str, Group] = {}  # aborted this step over an error in their own data

    def _plan_device_memory(self, kv_dtype: str) -> int:
        import jax

        from jaxserve.runtime import memory
        from jaxserve.runtime import runner as rt

        limit, in_use = memory.device_memory(jax.devices()[0])
        tp = self.config.tensor_parallel_size
        plan = memory.plan_kv_memory(  # a GPU pool sized by size_gpu_pool: planned against the whole device
            device_limit=memory.device_total(limit, jax.default_backend()), allocator_limit=limit,
            bytes_in_use=in_use, activation_bytes=self.runner.peak_step_bytes(),
            block_bytes=rt.kv_bytes_per_block(self.model_config, self.config.block_size, kv_dtype, tp,
                                              self.runner.backend.kv_layout),
            block_size=self.config.block_size, max_model_len=self.max_model_len,
            utilization=self.config.gpu_memory_utilization, tensor_parallel_size=tp, reserved_blocks=1,
        )
        log.info(memory.summary(plan))
        self.runner.resize_kv(plan.num_blocks)
        return plan.num_blocks

    def _blocks_from_budget(self, dtype: str) -> int:
        from jaxserve.runtime import runner as rt

        budget = rt.kv_memory_budget(self.config.kv_cache_memory, self.config.memory_fraction, 0)
        per_block = rt.kv_bytes_per_block(self.model_config, self.config.block_size, dtype,
                                          self.config.tensor_parallel_size)  # per device
        blocks = budget // per_block
        if blocks < 2:
            raise UserError(
                f"The KV cache budget of {budget / 2**20:.1f} MiB holds no block of {per_block / 2**20:.2f} MiB: "
                "raise --kv-cache-memory or --gpu-memory-utilization."
            )
        return int(blocks)

    def precompile(self, progress=None) -> float:
        from jaxserve.runtime import memory

        took = self.runner.precompile(progress)
        if self.pooling_config.declared:  # an embedding model: the steps of its pooling requests too
            took += self.runner.precompile(progress, keys=[k._replace(pool=True) for k in self.runner.all_buckets()
                                                           if not k.w])
        if self.drafter is not None:
            took += self.drafter.precompile()
        maps = memory.memory_maps()
        warning = maps and memory.map_count_warning(*maps, self.runner.num_compiles)
        if warning:
            log.warning(warning)
        return took

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
            raise UserError(f"Request id {request_id!r} is already in use.")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise UserError("The prompt must be a string or a list of token ids.", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ())):
            if (t := max(ids, default=-1)) >= self.model_config.vocab_size:
                raise UserError(f"Token id {t} is out of vocabulary (size {self.model_config.vocab_size}).",
                                param=name)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._check_row_width(params, len(prompt_token_ids), max_tokens)
        now = time.time() if arrival_time is None else arrival_time
        group = Group(request_id, prompt, prompt_token_ids, params, metrics=RequestMetrics(arrival_time=now),
                       priority=priority, cache_salt=cache_salt)
        eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        prompt_set = frozenset(prompt_token_ids) if params.uses_penalties else frozenset()
        reqs = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = (params.seed + i) % 2**64 if params.seed is not None else self._rng.getrandbits(64)
            req = Request(rid, list(prompt_token_ids), max_tokens, arrival_time=now, priority=priority,
                          cache_salt=cache_salt, eos_token_ids=eos, stop_token_ids=frozenset(params.stop_token_ids))
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            )
            out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            group.seqs.append(Seq(request_id, req, i, seed, detok, out, prompt_set))
            reqs.append(req)
        if params.pooling is not None:
            head = self.score_head
            if params.pooling.score and isinstance(head, str):
                raise UserError(head, param="model")
            group.pooler = Pooler(params.pooling, len(prompt_token_ids), head if params.pooling.score else None)
            reqs[0].score_prompt = params.pooling.every_row and len(prompt_token_ids) > 1
        if params.prompt_logprobs is not None:  # computed once, by the first sequence's prefill
            group.prompt_logprobs = [None] * len(prompt_token_ids)
            group.prompt_logprobs_missing = len(prompt_token_ids) - 1
            reqs[0].score_prompt = group.prompt_logprobs_missing > 0
        for req in reqs:
            self.scheduler.check_request(req)  # raises for requests the cache can never hold
        spec = getattr(params, "structured_outputs", None)
        if spec is not None:
            # Compiled on the compiler's threads (the server compiles before admission, so this is
            # a cache hit there); the request joins the scheduler once its grammar is ready, and
            # the batch never waits for it.
            future = self.grammar_compiler.submit(spec)
            if future.done() and future.exception() is not None:
                raise future.exception()
            self._waiting_grammar.append((group, future))
        else:
            for req in reqs:
                self.scheduler.add_request(req)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seqs[s.req.request_id] = s
        self.counters["prompt_tokens"] += len(prompt_token_ids)

    def _check_row_width(self, params: SamplingParams, prompt_len: int, max_tokens: int) -> None:
        """Admission: the widest sampling row this request can ever need fits the executable's
        adjustment width, so no later step can fail for its size (limits.py)."""
        bans = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids) \
            if params.min_tokens else set()
        lookahead = self.config.speculative.num_speculative_tokens if self.config.speculative else 0
        worst = limits.worst_row_adjustments(
            bias_and_bans=len(set(params.logit_bias or ()) | bans), prompt_len=prompt_len,
            max_tokens=max_tokens, penalties=params.uses_penalties,
            repetition=params.repetition_penalty != 1.0, vocab_size=self.model_config.vocab_size,
            lookahead=lookahead)
        limits.check_row_width(worst, self.runner.builder.max_adjustments, penalties=params.uses_penalties)

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("The prompt cannot be empty: send at least one token.", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"Token id {bad} is out of vocabulary (the model's ids are 0..{vocab - 1}).",
                            param="prompt")
        if len(ids) >= self.max_model_len:
            raise UserError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "shorten the prompt or start the engine with a larger --max-model-len.", param="prompt",
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

    def _admit_compiled(self, outputs: dict[str, Group]) -> None:
        """Requests whose grammar is compiled join the scheduler, each sequence with a matcher."""
        still = []
        for group, future in self._waiting_grammar:
            if group.request_id not in self._groups:
                continue  # aborted while compiling
            if not future.done():
                still.append((group, future))
                continue
            error = future.exception()
            for seq in group.seqs:
                if error is not None:
                    log.error("request %s: its grammar failed to compile: %s", group.request_id, error)
                    seq.out.finish_reason, seq.out.stop_reason = "abort", str(error)
                    continue
                seq.matcher = future.result().matcher()
                self.scheduler.add_request(seq.req)
            if error is not None:
                group.metrics.finished_time = time.time()
                outputs[group.request_id] = group
        self._waiting_grammar = still

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._inflight is not None

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then process the one before it while the device
        runs (overlap: one step in flight; `async_scheduling=False` processes each step at once)."""
        t0 = time.perf_counter()
        wait0 = self.timing["device_wait_s"]
        outputs: dict[str, Group] = {}
        if self._waiting_grammar:
            self._admit_compiled(outputs)
        if self._inflight is not None and self._inflight.needs_tokens:
            self._process(self._inflight, outputs)  # its tokens feed the next step's sampling
            self._inflight = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._seqs)
        sched = self.scheduler.schedule()
        for req in sched.finished:  # ended by the scheduler (outgrew the whole KV cache)
            seq = self._seqs.get(req.request_id)
            if seq is not None and seq.group_id in self._groups:
                self._finish(self._groups[seq.group_id], seq, req.status, None)
                outputs[seq.group_id] = self._groups[seq.group_id]
        new = self._dispatch(sched) if sched.scheduled else None
        if self._inflight is not None:
            self._process(self._inflight, outputs)
        self._inflight = new
        if new is not None and (not self.config.async_scheduling or self.drafter is not None):
            self._process(new, outputs)
            self._inflight = None
        elif new is not None and all(sr.request.is_finished for sr in new.sched.scheduled):
            self._inflight = None  # every row already stopped: nothing of it will be read
        if self._failed:
            outputs.update(self._failed)
            self._failed = {}
        result = [self._output(g) for g in outputs.values()]
        t = self.timing
        t["host_s"] += time.perf_counter() - t0 - (t["device_wait_s"] - wait0)
        t["steps"] += 1
        return result

    def _dispatch(self, sched: SchedulerOutput) -> _Inflight:
        now = time.time()
        # Decode rows (one new token) first: the XLA attention takes them in a loop of their own.
        scheduled = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        if self.speculator is not None:
            self.speculator.draft_tokens(scheduled, self._seqs)
        prev = self._inflight.row_of if self._inflight is not None else {}
        rows, seqs, kept = [], [], []
        for sr in scheduled:
            try:
                row, seq = self._row(sr, prev, now)
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                self._fail(self._seqs[sr.request.request_id].group_id, e, "building its step row")
                continue
            rows.append(row)
            seqs.append(seq)
            kept.append(sr)
        scheduled = [sr for sr in kept if not sr.request.is_finished]  # a failed group's siblings too
        rows = [r for r, sr in zip(rows, kept) if not sr.request.is_finished]
        seqs = [q for q, sr in zip(seqs, kept) if not sr.request.is_finished]
        if not rows:
            return None
        batch, key = self._build(rows, seqs, scheduled)
        if not rows:
            return None
        return self._launch(sched, scheduled, rows, seqs, batch, key)

    def _row(self, sr, prev: dict, now: float) -> tuple[RowSpec, Seq]:
        """One scheduled request's row of the step."""
        req = sr.request
        seq = self._seqs[req.request_id]
        group = self._groups[seq.group_id]
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
        if sr.num_draft:  # verify the drafts: a logits row at the last token and at each draft
            drafts = req.spec_token_ids[:sr.num_draft]
            row = RowSpec(req.token_ids + drafts, sr.start, sr.num_new_tokens, req.block_ids,
                          self._sampling(group.params, seq, drafts), -1,
                          extra=[(j, self._sampling(group.params, seq, drafts[:j])) for j in range(len(drafts))])
            return row, seq
        sampling = self._sampling(group.params, seq) if sr.samples else None
        row = RowSpec(req.token_ids, sr.start, sr.num_new_tokens, req.block_ids, sampling,
                      prev.get(req.request_id, -1))
        if req.score_prompt:  # a logits row at each prompt token that predicts the next one
            score = Sampling(num_logprobs=-1 if group.pooler is not None else group.params.prompt_logprobs)
            end = min(sr.start + sr.num_new_tokens, len(req.prompt_token_ids) - 1)
            row.extra = [(p - sr.start, score) for p in range(sr.start, end)]
        width = self.runner.builder.max_adjustments
        for _, smp in [(0, row.sampling), *row.extra]:
            if smp is not None and smp.adjusts and smp.num_adjustments() > width:
                raise ValueError(f"{smp.num_adjustments()} logit adjustments exceed the widest row ({width})")
        return row, seq

    def _build(self, rows: list[RowSpec], seqs: list[Seq], scheduled: list) -> tuple:
        """The padded batch; a row that cannot be built alone fails its request, the rest go on
        (rows, seqs and scheduled are edited in place)."""
        try:
            return self.runner.builder.build(rows)
        except Exception as first:  # noqa: BLE001 - find the row(s) at fault
            bad = []
            for i, row in enumerate(rows):
                try:
                    self.runner.builder.build([row])
                except Exception as e:  # noqa: BLE001
                    bad.append(i)
                    self._fail(seqs[i].group_id, e, "building its step")
            if not bad:
                raise first  # not one request's data: the engine's own state is at fault
            keep = [i for i in range(len(rows)) if not scheduled[i].request.is_finished]
            rows[:] = [rows[i] for i in keep]
            seqs[:] = [seqs[i] for i in keep]
            scheduled[:] = [scheduled[i] for i in keep]
            return self.runner.builder.build(rows) if rows else (None, None)

    def _launch(self, sched: SchedulerOutput, scheduled: list, rows: list[RowSpec], seqs: list[Seq],
                batch, key) -> _Inflight:
        constrained = [None] * key.s
        verifying = {}
        for seq, r, sr in zip(seqs, rows, scheduled):
            if sr.num_draft:
                verifying[sr.request.request_id] = (r.first_row, sr.num_draft)
            elif r.sampling is not None:
                constrained[r.out_row] = seq.matcher
        if any(m is not None for m in constrained):  # filled on the host, applied in the executable
            self._bitmask_filler.fill(constrained, batch.bitmask)
        for seq, r, sr in zip(seqs, rows, scheduled):
            if sr.num_draft and seq.matcher is not None:  # the grammar's state after each draft
                self.speculator.fill_masks(seq.matcher, r.token_ids[-sr.num_draft:], batch.bitmask[r.first_row:])
        pooled = [(i, *self._pool_rows(r)) for i, (seq, r) in enumerate(zip(seqs, rows))
                  if self._pooler(seq) is not None]
        if pooled:
            key = key._replace(pool=True)  # the executable also returns the rows' hidden states
        want_logprobs = any((r.sampling is not None and r.sampling.num_logprobs >= 0) or r.extra
                            for r, seq in zip(rows, seqs) if self._pooler(seq) is None)
        result = self.runner.execute(batch, key)
        # Was the device still on the step before when this one was queued behind it?
        ahead = self._inflight
        self.timing["dispatch_busy" if ahead is not None and not ahead.result.tokens.is_ready() else "dispatch_idle"] += 1
        if self.drafter is not None:
            self.drafter.mirror(batch, key._replace(pool=False))
        sched.scheduled = scheduled  # row order
        self.scheduler.dispatched(sched)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_batched_tokens
        return _Inflight(
            sched, seqs, result, key, want_logprobs,
            needs_tokens=any(r.sampling is not None and (r.sampling.uses_penalties or r.sampling.constrained
                                                         or (self.speculator is not None and
                                                             self.speculator.due(seq, self.scheduler.num_running)))
                             for r, seq in zip(rows, seqs)),
            row_of={sr.request.request_id: r.out_row for sr, r in zip(scheduled, rows) if sr.samples},
            verifying=verifying,
            scored=[(i, r.first_row, r.start, len(r.extra)) for i, (r, seq) in enumerate(zip(rows, seqs))
                    if r.extra and self._pooler(seq) is None],
            pooled=pooled,
        )

    def _pooler(self, seq: Seq):
        group = self._groups.get(seq.group_id)
        return group.pooler if group is not None else None

    @staticmethod
    def _pool_rows(r: RowSpec) -> tuple[list[int], list[int]]:
        """A pooling row's logits rows and the prompt positions they read: its extra rows (every
        token, for mean / CLS pooling), then its last token's when it samples."""
        rows = list(range(r.first_row, r.first_row + len(r.extra)))
        positions = [r.start + off for off, _ in r.extra]
        if r.out_row >= 0:
            rows.append(r.out_row)
            positions.append(r.start + r.num_new - 1)
        return rows, positions

    def _sampling(self, p: SamplingParams, seq: Seq, ahead: list[int] = ()) -> Sampling:
        """The row's sampling; `ahead`: drafted tokens before it (a verification row samples as
        if they were output already: its step, penalty counts and min_tokens bans)."""
        req = seq.req
        n_out = req.num_output_tokens + len(ahead)
        bias = dict(p.logit_bias or {})
        if n_out < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids):
                bias[t] = -np.inf
        return Sampling(
            temperature=p.temperature, top_k=p.top_k if p.top_k < self.model_config.vocab_size else 0,  # all: off
            top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
            step=n_out, num_logprobs=-1 if p.logprobs is None else p.logprobs,
            logprob_ids=tuple(p.logprob_token_ids or ()),
            presence=p.presence_penalty, frequency=p.frequency_penalty, repetition=p.repetition_penalty,
            bias=bias, prompt_tokens=seq.prompt_set if p.uses_penalties else frozenset(),
            output_counts=(self._counts_ahead(seq.counts, ahead) if ahead else seq.counts) if p.uses_penalties else {},
            constrained=seq.matcher is not None,
        )

    @staticmethod
    def _counts_ahead(counts: dict, ahead: list[int]) -> dict:
        out = dict(counts)
        for t in ahead:
            out[t] = out.get(t, 0) + 1
        return out

    def _process(self, step: _Inflight, outputs: dict[str, Group]) -> None:
        """Read a dispatched step's tokens and update its requests: token-level stops in the
        scheduler, then detokenization, stop strings and logprobs here."""
        t0 = time.perf_counter()
        got = self.runner.fetch(step.result, step.key.s, step.want_logprobs, accepted=bool(step.verifying),
                                hidden=bool(step.pooled))
        self.timing["device_wait_s"] += time.perf_counter() - t0
        tokens = got.tokens
        for i, rows, positions in step.pooled:
            group = self._groups.get(step.seqs[i].group_id)
            try:
                if group is not None:
                    group.pooler.add(positions, got.hidden[rows])
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                self._fail(group.request_id, e, "pooling its hidden states")
        for i, first, pos, count in step.scored:
            try:
                self._score_prompt(step.seqs[i], got, first, pos, count)
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                self._fail(step.seqs[i].group_id, e, "scoring its prompt")
        emitted: dict[int, list[int]] = {}  # row -> logits rows of the tokens it emits, in order
        for i, sr in enumerate(step.sched.scheduled):
            if not sr.samples or sr.request.is_finished:
                continue
            v = step.verifying.get(sr.request.request_id)
            if v is None:
                emitted[i] = [step.row_of[sr.request.request_id]]
                continue
            first, k = v  # each accepted draft, then the token of the first row that rejects (or the bonus)
            n = next((m for m in range(k) if not got.accepted[first + m]), k)
            emitted[i] = list(range(first, first + n + 1))
            self.speculator.record(k, n)
        sched = step.sched.scheduled
        sampled = {sched[i].request.request_id: ([int(tokens[j]) for j in rs] if sched[i].num_draft else int(tokens[rs[0]]))
                   for i, rs in emitted.items()}
        landed = self.scheduler.update_from_output(step.sched, sampled)
        for i, rs in emitted.items():
            seq = step.seqs[i]
            group = self._groups.get(seq.group_id)
            if group is None or seq.out.finished:
                continue
            kept = landed[seq.req.request_id]
            try:
                for m, (j, tok) in enumerate(zip(rs, kept.tokens)):
                    lp = None
                    if seq.out.logprobs is not None:
                        n = group.params.logprobs
                        lp = TokenLogprob(tok, float(got.logprobs[j]),
                                          [(int(a), float(b)) for a, b in zip(got.top_ids[j, :n], got.top_logprobs[j, :n])])
                    self._append(group, seq, tok, lp, kept.stop if m == len(kept.tokens) - 1 else None)
                    if seq.out.finished:
                        break
            except Exception as e:  # noqa: BLE001 - detokenizing, stop strings, its grammar: it fails alone
                self._fail(group.request_id, e, "reading back its tokens")
                continue
            outputs[group.request_id] = group

    def _fail(self, group_id: str, error: BaseException, where: str) -> None:
        """Abort one request over an error in its own data: its choices finish ("abort"), its
        blocks are freed, its output carries the error; every other request goes on."""
        group = self._groups.get(group_id)
        if group is None:
            return
        log.error("request %s failed while %s; it is aborted, the engine goes on", group_id, where,
                  exc_info=error)
        group.error = f"The request failed while {where}: {type(error).__name__}: {str(error)[:300]}"
        for seq in group.seqs:
            if not seq.out.finished:
                try:
                    seq.finish(RequestStatus.FINISHED_ABORTED, None)
                except Exception:  # noqa: BLE001 - its detokenizer may be what failed
                    seq.out.finish_reason = "abort"
            if not seq.req.is_finished:
                self.scheduler.finish_request(seq.req, RequestStatus.FINISHED_ABORTED)
        group.metrics.finished_time = time.time()
        self._failed[group_id] = group

    def _score_prompt(self, seq: Seq, got, first: int, pos: int, count: int) -> None:
        """Prompt logprobs from logits rows first.. (positions pos..: each scores the next token)."""
        group = self._groups.get(seq.group_id)
        if group is None or not seq.req.score_prompt:
            return
        n = group.params.prompt_logprobs
        lps = group.prompt_logprobs
        ids = group.prompt_token_ids
        for k in range(count):
            j, p = first + k, pos + k + 1
            if lps[p] is None:
                group.prompt_logprobs_missing -= 1
            lps[p] = TokenLogprob(ids[p], float(got.verify_logprobs[j]),
                                  [(int(a), float(b)) for a, b in zip(got.top_ids[j, :n], got.top_logprobs[j, :n])])
        if group.prompt_logprobs_missing == 0:
            seq.req.score_prompt = False  # from now on it is an ordinary request (cache included)

    def _append(self, group: Group, seq: Seq, token: int, lp: TokenLogprob | None, stop) -> None:
        """Record a sampled token; `stop` is the scheduler's token-level verdict (status, reason)."""
        now = time.time()
        m = group.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        self.counters["generation_tokens"] += 1
        stop = seq.add_token(token, lp, stop, group.params, self.eos_token_ids)
        if stop is not None:
            self._finish(group, seq, *stop)

    def _finish(self, group: Group, seq: Seq, status: RequestStatus, stop_reason) -> None:
        seq.finish(status, stop_reason)
        if not seq.req.is_finished:
            self.scheduler.finish_request(seq.req, status)
        if group.finished:
            group.metrics.finished_time = time.time()

    def _output(self, group: Group) -> RequestOutput:
        out = group.snapshot()
        if out.finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                self._seqs.pop(s.req.request_id, None)
        return out

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
        if self.speculator is not None:
            stats.update(self.speculator.summary())
        return stats

