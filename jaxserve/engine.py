"""LLMEngine: requests in, one scheduled step at a time, outputs out.

    add_request -> Admission -> [schedule -> StepPlanner (rows, batch) -> runner -> OutputProcessor]* -> outputs

The engine wires the pieces and owns the one-step-in-flight loop (overlap): while the device runs
step k, the host reads step k-1's tokens. Admission checks and fans out a request (admission.py);
the planner turns the scheduler's output into the step's rows and batch (planner.py); the output
processor turns fetched arrays into request outputs (output_processor.py); what a token does to
one sequence is in sequence.py.

Overlap is kept for every row whose next step does not need this step's token on the host: a
row with penalties (its counts), a grammar (its mask is filled on the host) or a draft due next
step (the drafter reads the token) makes the engine read the step before dispatching the next.
"""

from __future__ import annotations

import logging
import time

from jaxserve import default_format
from jaxserve.admission import Admission, GrammarWait
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.errors import UserError
from jaxserve.kv_plan import initial_blocks, log_kv_cache, plan_device_memory
from jaxserve.model.loader import load_model, release_header
from jaxserve.outputs import RequestOutput
from jaxserve.output_processor import OutputProcessor
from jaxserve.planner import Inflight, StepPlanner
from jaxserve.pooling import PoolingConfig, score_head
from jaxserve.runtime import memory
from jaxserve.runtime.kv_sizing import default_dtype, default_kv_cache_dtype
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq
from jaxserve.spec.speculator import Speculator
from jaxserve.startup_trace import mark
from jaxserve.step_clock import StepClock
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.tokenizer import Tokenizer
from jaxserve.worker import runner as rt
from jaxserve.worker import xla_cache

log = logging.getLogger("jaxserve")


class LLMEngine:
    supports_structured_outputs = True  # grammars are applied to the logits (tests key on this)

    def __init__(self, config: EngineConfig | None = None, *, kv_for_sequences: int | None = None, **kwargs):
        """kv_for_sequences: KV for at most this many max_model_len sequences (kv_plan.initial_blocks)."""
        mark("imports")
        self.config = config = config or EngineConfig(**kwargs)
        memory.size_gpu_pool(config.gpu_memory_utilization)  # before jax starts its GPU backend
        if config.compilation_cache:
            xla_cache.enable()
        dtype = config.dtype or default_dtype()
        # the weight format: the user's, else this machine's default (default_format.py), said once
        self.quantization = default_format.for_engine(config)
        quantization = None if self.quantization == "none" else self.quantization
        mark("weight format")
        self.loaded = load_model(config.model, quantization=quantization)
        mark("weights read")
        self.model_config = mc = self.loaded.config
        kv_dtype = config.kv_cache_dtype or default_kv_cache_dtype(dtype, mc.checkpoint_dtype)
        self.tokenizer = Tokenizer.from_pretrained(self.loaded.path)
        release_header(self.loaded.path)  # a GGUF's, parsed once for the three readers above
        mark("tokenizer")
        self.pooling_config = PoolingConfig.from_model(self.loaded.path)
        # rerank / score: the LM-head columns of the two score tokens, or why there are none
        self.score_head = score_head(self.loaded.params, mc, self.tokenizer, config.score_tokens)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # on a device the cache is sized after the runner's largest step (plan_device_memory below)
        self.num_blocks, on_device = initial_blocks(config, mc, kv_dtype, self.max_model_len, kv_for_sequences)
        self.runner = rt.ModelRunner(mc, self.loaded.params, rt.RunnerConfig(
            block_size=config.block_size, num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            attention_backend=config.attention_backend, dtype=dtype, kv_cache_dtype=kv_dtype,
            tensor_parallel_size=config.tensor_parallel_size, quantization=quantization,
            enable_expert_parallel=config.enable_expert_parallel,
        ))
        self.loaded.params = None  # host copy no longer needed
        if on_device:
            self.num_blocks = plan_device_memory(config, mc, self.runner, kv_dtype, self.max_model_len)
        # the draft method's model (drafter) mirrors the target's steps (always synchronous)
        self.speculator, self.drafter = Speculator.for_config(config.speculative, self.runner.cfg, self.num_blocks,
                                                              mc.vocab_size)
        self.scheduler = Scheduler(config.scheduler_config(
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            max_num_logit_rows=self.runner.builder.s_max))
        self.eos_token_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self._groups: dict[str, Group] = {}
        self._seqs: dict[str, Seq] = {}  # core request id -> seq
        self._inflight: Inflight | None = None  # the dispatched step not yet read
        self._busy = False  # the last step() left requests unfinished (step: the first after idle)
        self.counters = dict(steps=0, prompt_tokens=0, generation_tokens=0, computed_tokens=0)
        # step gaps -> the prefill cap next to decodes (--itl-target-ms); host and device-wait time per
        # step (bench/host_overhead.py); JAXSERVE_STEP_TRACE's lines
        self.clock = StepClock(config.max_num_batched_tokens, config.itl_target_ms)
        self.timing = self.clock.timing
        self.kv_capacity_tokens = log_kv_cache(config, mc, self.runner, self.num_blocks, kv_dtype, self.max_model_len)
        self.admission = Admission(
            tokenizer=self.tokenizer, vocab_size=mc.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids, max_adjustments=self.runner.builder.max_adjustments,
            lookahead=config.speculative.num_speculative_tokens if config.speculative else 0,
            score_head=self.score_head, seed=config.seed)
        self.validate_prompt = self.admission.validate_prompt
        self.planner = StepPlanner(self.runner.builder, mc.vocab_size, self.eos_token_ids)
        self.outputs = OutputProcessor(self._groups, self._seqs, self.scheduler, self.eos_token_ids,
                                       self.counters, self.speculator)
        # grammars compile on its threads, cached by spec (its tokenizer view is built on first use)
        self.grammar_compiler = GrammarCompiler.for_tokenizer(
            self.tokenizer, mc.vocab_size, eos_token_ids=sorted(self.eos_token_ids))
        self.grammars = GrammarWait(self.grammar_compiler)
        if on_device:  # the planned cache takes the device's memory once every bucket compiled
            if config.precompile:
                log.info("Compiling every step bucket before the KV cache takes the device's memory")
                self.precompile()
            self.runner.allocate_kv()
        mark("engine")

    def precompile(self, progress=None) -> float:
        took = self.runner.precompile(progress)
        if self.pooling_config.declared:  # an embedding model: the steps of its pooling requests too
            took += self.runner.precompile(progress, keys=[k._replace(pool=True) for k in self.runner.all_buckets()
                                                           if not k.w])
        if self.drafter is not None:
            took += self.drafter.precompile()
        memory.warn_on_map_count(self.runner.num_compiles)
        memory.trim_heap()
        mark("precompile")
        return took

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request. Raises UserError (a message for the user) if it can never run."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise UserError(f"Request id {request_id!r} is already in use.")
        group = self.admission.group(request_id, prompt, params, prompt_token_ids, arrival_time, priority, cache_salt)
        for s in group.seqs:
            self.scheduler.check_request(s.req)  # raises for requests the cache can never hold
        if params.structured_outputs is not None:  # joins the scheduler once its grammar is compiled
            self.grammars.add(group, params.structured_outputs)
        else:
            for s in group.seqs:
                self.scheduler.add_request(s.req)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seqs[s.req.request_id] = s
        self.counters["prompt_tokens"] += len(group.prompt_token_ids)

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
        return bool(self._groups) or self._inflight is not None

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then process the one before it while the device
        runs (overlap: one step in flight; `async_scheduling=False` processes each step at once)."""
        self.clock.begin()
        from_idle = not self._busy
        outputs: dict[str, Group] = {}
        self.grammars.admit(self._groups, self.scheduler, outputs)
        if self._inflight is not None and self._inflight.needs_tokens:
            self._process(self._inflight, outputs)  # its tokens feed the next step's sampling
            self._inflight = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._seqs)
        self.scheduler.prefill_cap = self.clock.prefill_cap()
        sched = self.scheduler.schedule()
        for req in sched.finished:  # ended by the scheduler (outgrew the whole KV cache)
            seq = self._seqs.get(req.request_id)
            if seq is not None and seq.group_id in self._groups:
                self.outputs.finish(self._groups[seq.group_id], seq, req.status, None)
                outputs[seq.group_id] = self._groups[seq.group_id]
        new = self._dispatch(sched) if sched.scheduled else None
        if self._inflight is not None:
            self._process(self._inflight, outputs)
        self._inflight = new
        # The first step after the engine was idle is read back at once, not overlapped with the
        # next one's scheduling: requests sent together reach an idle engine one by one, and the
        # step scheduled next to it would carry only those that came in the first few milliseconds
        # (a lone decode, or a 90-token chunk); read at once, the next step takes every one that
        # came while the first ran (bench/RESULTS.md, "Tails ... arrivals").
        if new is not None and (from_idle or not self.config.async_scheduling or self.drafter is not None):
            self._process(new, outputs)
            self._inflight = None
        elif new is not None and all(sr.request.is_finished for sr in new.sched.scheduled):
            self._inflight = None  # every row already stopped: nothing of it will be read
        if self.outputs.failed:
            outputs.update(self.outputs.failed)
            self.outputs.failed = {}
        result = [self.outputs.output(g) for g in outputs.values()]
        self._busy = self.has_unfinished_requests()
        self.clock.end(idle=self._inflight is None)
        return result

    def _dispatch(self, sched: SchedulerOutput) -> Inflight | None:
        """Plan the step's rows, build its batch and launch it (a row whose data fails fails its
        own request); returns what to read back."""
        scheduled = self.planner.order(sched.scheduled)
        if self.speculator is not None:
            self.speculator.draft_tokens(scheduled, self._seqs)
        prev = self._inflight.row_of if self._inflight is not None else {}
        rows, seqs, scheduled = self.planner.plan(scheduled, self._seqs, self._groups, prev, self.outputs.fail)
        if not rows:
            return None
        batch, key, rowmap = self.planner.build(rows, seqs, scheduled, self.outputs.fail)
        if not rows:
            return None
        self.planner.fill_masks(batch, key, rows, seqs, scheduled, rowmap, self.speculator)
        pooling = [self._groups[s.group_id].pooler is not None for s in seqs]
        if any(pooling):
            key = key._replace(pool=True)  # the executable also returns the rows' hidden states
        result = self.runner.execute(batch, key)
        # Was the device still on the step before when this one was queued behind it?
        self.clock.queued(busy=self._inflight is not None and not self._inflight.result.tokens.is_ready())
        if self.drafter is not None:
            self.drafter.mirror(batch, key._replace(pool=False))
        sched.scheduled = scheduled  # row order
        self.scheduler.dispatched(sched)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_batched_tokens
        due = [self.speculator is not None and self.speculator.due(s, self.scheduler.num_running) for s in seqs]
        step = self.planner.inflight(sched, rows, seqs, rowmap, result, key, pooling, due)
        self.clock.dispatched(step)
        return step

    def _process(self, step: Inflight, outputs: dict[str, Group]) -> None:
        """Read a dispatched step's arrays (the device wait is timed) and update its requests."""
        t0 = time.perf_counter()
        got = self.runner.fetch(step.result, step.key.s, step.want_logprobs, accepted=bool(step.verifying),
                                hidden=bool(step.pooled))
        self.clock.read(step, self.scheduler, waited_s=time.perf_counter() - t0)
        self.outputs.process(step, got, outputs)

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

