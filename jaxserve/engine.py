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

import time

from jaxserve import default_format
from jaxserve.admission import Admission, admit_compiled
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.core.step_budget import StepBudget
from jaxserve.errors import UserError
from jaxserve.kv_plan import blocks_from_budget, log_kv_cache, plan_device_memory, sized_on_device
from jaxserve.model.loader import load_model
from jaxserve.outputs import RequestOutput
from jaxserve.output_processor import OutputProcessor
from jaxserve.planner import Inflight, StepPlanner
from jaxserve.pooling import PoolingConfig, score_head
from jaxserve.runtime import memory
from jaxserve.runtime.kv_sizing import default_dtype, default_kv_cache_dtype
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq
from jaxserve.spec.draft import DraftModel
from jaxserve.spec.speculator import Speculator
from jaxserve.step_trace import StepTrace
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.tokenizer import Tokenizer
from jaxserve.worker import runner as rt

class LLMEngine:
    supports_structured_outputs = True  # grammars are applied to the logits (tests key on this)

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        memory.size_gpu_pool(config.gpu_memory_utilization)  # before jax starts its GPU backend
        if config.compilation_cache:
            rt.enable_compilation_cache()
        dtype = config.dtype or default_dtype()
        # the weight format: the user's, else this machine's default (default_format.py), said once
        self.quantization = default_format.for_engine(config)
        quantization = None if self.quantization == "none" else self.quantization
        self.loaded = load_model(config.model, quantization=quantization)
        self.model_config = mc = self.loaded.config
        kv_dtype = config.kv_cache_dtype or default_kv_cache_dtype(dtype, mc.checkpoint_dtype)
        self.tokenizer = Tokenizer.from_pretrained(self.loaded.path)
        self.pooling_config = PoolingConfig.from_model(self.loaded.path)
        # rerank / score: the LM-head columns of the two score tokens, or why there are none
        self.score_head = score_head(self.loaded.params, mc, self.tokenizer, config.score_tokens)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        on_device = sized_on_device(config)  # then the cache is sized after the runner's largest step
        self.num_blocks = config.num_blocks or (2 if on_device else blocks_from_budget(config, mc, kv_dtype))
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
        self.speculator = None
        self.drafter = None  # the draft method's model: it mirrors the target's steps (always synchronous)
        if config.speculative is not None:
            if config.speculative.method == "draft":
                self.drafter = DraftModel(config.speculative.model, self.runner.cfg, self.num_blocks, mc.vocab_size)
            self.speculator = Speculator(config.speculative, self.drafter)
        self.scheduler = Scheduler(config.scheduler_config(
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            max_num_logit_rows=self.runner.builder.s_max))
        self.eos_token_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self._groups: dict[str, Group] = {}
        self._seqs: dict[str, Seq] = {}  # core request id -> seq
        self._inflight: Inflight | None = None  # the dispatched step not yet read
        self.counters = dict(steps=0, prompt_tokens=0, generation_tokens=0, computed_tokens=0)
        # host time in step() besides the device wait; that wait; steps dispatched while the step before
        # still ran on the device (their host time hidden) / onto an idle one (bench/host_overhead.py)
        self.timing = dict(host_s=0.0, device_wait_s=0.0, steps=0, dispatch_busy=0, dispatch_idle=0)
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
        self._waiting_grammar: list[tuple[Group, object]] = []  # (group, Future) until compiled
        self.trace = StepTrace.from_env()  # JAXSERVE_STEP_TRACE: one JSON line per step (step_trace.py)
        self._last_host_s = 0.0
        # prefill tokens next to decodes, sized for the ITL target from measured step gaps (step_budget.py)
        target = config.itl_target_ms
        self.step_budget = StepBudget(config.max_num_batched_tokens, None if target is None else target / 1e3)
        self._last_read: float | None = None  # when the step before was read (None: the engine went idle)

    def precompile(self, progress=None) -> float:
        took = self.runner.precompile(progress)
        if self.pooling_config.declared:  # an embedding model: the steps of its pooling requests too
            took += self.runner.precompile(progress, keys=[k._replace(pool=True) for k in self.runner.all_buckets()
                                                           if not k.w])
        if self.drafter is not None:
            took += self.drafter.precompile()
        memory.warn_on_map_count(self.runner.num_compiles)
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
        spec = params.structured_outputs
        if spec is not None:
            # Compiled on the compiler's threads (the server compiles before admission, so this is
            # a cache hit there); the request joins the scheduler once its grammar is ready.
            future = self.grammar_compiler.submit(spec)
            if future.done() and future.exception() is not None:
                raise future.exception()
            self._waiting_grammar.append((group, future))
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
        t0 = time.perf_counter()
        wait0 = self.timing["device_wait_s"]
        outputs: dict[str, Group] = {}
        if self._waiting_grammar:
            self._waiting_grammar = admit_compiled(self._waiting_grammar, self._groups, self.scheduler, outputs)
        if self._inflight is not None and self._inflight.needs_tokens:
            self._process(self._inflight, outputs)  # its tokens feed the next step's sampling
            self._inflight = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._seqs)
        self.scheduler.prefill_cap = self.step_budget.cap()
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
        if new is not None and (not self.config.async_scheduling or self.drafter is not None):
            self._process(new, outputs)
            self._inflight = None
        elif new is not None and all(sr.request.is_finished for sr in new.sched.scheduled):
            self._inflight = None  # every row already stopped: nothing of it will be read
        if self.outputs.failed:
            outputs.update(self.outputs.failed)
            self.outputs.failed = {}
        result = [self.outputs.output(g) for g in outputs.values()]
        t = self.timing
        self._last_host_s = time.perf_counter() - t0 - (t["device_wait_s"] - wait0)
        t["host_s"] += self._last_host_s
        t["steps"] += 1
        if self._inflight is None:
            self._last_read = None  # the next step's gap would include the idle time
            if self.trace is not None:
                self.trace.idle()
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
        ahead = self._inflight
        self.timing["dispatch_busy" if ahead is not None and not ahead.result.tokens.is_ready()
                    else "dispatch_idle"] += 1
        if self.drafter is not None:
            self.drafter.mirror(batch, key._replace(pool=False))
        sched.scheduled = scheduled  # row order
        self.scheduler.dispatched(sched)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_batched_tokens
        due = [self.speculator is not None and self.speculator.due(s, self.scheduler.num_running) for s in seqs]
        step = self.planner.inflight(sched, rows, seqs, rowmap, result, key, pooling, due)
        if self.trace is not None:
            step.dispatched = self.trace.now()
        return step

    def _process(self, step: Inflight, outputs: dict[str, Group]) -> None:
        """Read a dispatched step's arrays (the device wait is timed) and update its requests."""
        t0 = time.perf_counter()
        got = self.runner.fetch(step.result, step.key.s, step.want_logprobs, accepted=bool(step.verifying),
                                hidden=bool(step.pooled))
        now = time.perf_counter()
        self.timing["device_wait_s"] += now - t0
        sched = step.sched
        if self._last_read is not None and sched.num_decode_tokens:
            self.step_budget.observe(sched.num_prefill_tokens, now - self._last_read)
        self._last_read = now
        self.outputs.process(step, got, outputs)
        if self.trace is not None:
            self.trace.record(step=sched.step, key=step.key, prefill=sched.num_prefill_tokens,
                              decode=sched.num_decode_tokens, dispatched=step.dispatched, host_s=self._last_host_s,
                              prefill_cap=sched.prefill_cap, running=self.scheduler.num_running,
                              waiting=self.scheduler.num_waiting)

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

