"""Continuous batching, as in vLLM V1: every step is one ragged batch of decode tokens and prefill
chunks under a token budget and a sequence cap.

Order of work: running requests first (decode-first, the default) or waiting requests first
(prefill-first); waiting requests are admitted in policy order (`policy.py`). Chunked prefill is
always on. When a running request cannot get a block, the KV manager has already used free blocks
and evicted unreferenced cached ones; the scheduler then preempts (recompute) the running request
with the lowest priority / latest arrival, which goes back to the front of the waiting queue.

Admission (`admission`):
- `optimistic` (vLLM, the default): admit while the prompt's blocks fit above a small watermark.
  Under load the running requests then grow into memory that new admissions took, and the newest
  get preempted, often again and again: a preempted request is re-admitted as soon as its tokens
  fit, and preempted a few steps later.
- `conservative` (SGLang's new_token_ratio, growth.py): free + evictable blocks must also cover what the
  running requests and the new one are expected to grow: the rest of their prompt plus
  ratio x the output tokens they may still generate. The ratio starts at `init_new_token_ratio`,
  decays each step to a floor (requests often stop before max_tokens), and after a preemption is
  re-estimated from the survivors' progress. The first request into an empty batch is admitted on
  its prompt alone, so a request is never held back forever.
"""

from __future__ import annotations

from .batch import PENDING
from .burst import Burst
from .errors import UserError
from .growth import NewTokenRatio
from .kv_manager import KVManager, cdiv
from .policy import WaitingQueue
from .request import Request, RequestStatus
from .scheduler_config import SchedulerConfig
from .scheduler_output import Landed, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVManager(
            config.num_blocks, config.block_size, config.prefix_cache, config.eviction, config.hash_seed
        )
        self.waiting = WaitingQueue(config, self.kv)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0
        # the most prefill tokens a step with decode rows may carry (None: max_num_batched_tokens);
        # the engine sets it each step from measured step times (core/step_budget.py)
        self.prefill_cap: int | None = None
        self.burst = Burst()  # a burst of arrivals being prefilled (burst.py)
        self._order: dict[str, int] = {}  # arrival order, for victims and fcfs ties
        self._next_order = 0
        self._watermark_blocks = int(config.watermark * (config.num_blocks - 1))
        self.growth = NewTokenRatio(config.init_new_token_ratio)  # conservative admission's estimate (growth.py)

    # ---- requests in and out ------------------------------------------------------------------
    def check_request(self, req: Request) -> None:
        """Raise a UserError if the request can never run here."""
        cfg = self.config
        if req.request_id in self.requests:
            raise UserError(f"request id {req.request_id!r} is already in the scheduler")
        if req.num_tokens < 1:
            raise UserError("The prompt cannot be empty: send at least one token.", param="prompt")
        if req.num_tokens >= cfg.max_model_len:
            raise UserError(
                f"request {req.request_id!r}: the prompt has {req.num_tokens} tokens but max_model_len "
                f"is {cfg.max_model_len}, which must leave room for at least one generated token; "
                "shorten the prompt or raise max_model_len", param="prompt"
            )
        capacity = cfg.num_blocks - 1
        if cdiv(req.num_tokens + 1, cfg.block_size) > capacity:
            raise UserError(
                f"request {req.request_id!r}: {req.num_tokens} prompt tokens need "
                f"{cdiv(req.num_tokens + 1, cfg.block_size)} KV blocks but the whole cache has "
                f"{capacity} ({capacity * cfg.block_size} tokens); shorten the prompt or give the "
                "KV cache more memory", param="prompt"
            )

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._order[req.request_id] = self._next_order
        self._next_order += 1
        self.waiting.add(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        assert status.is_finished, f"{status!r} is not a finished status"
        if req.request_id not in self.requests:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.forget(req)
        del self.requests[req.request_id]
        del self._order[req.request_id]

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def new_token_ratio(self) -> float:
        return self.growth.value

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.step)
        tokens = self.config.max_num_batched_tokens
        # prefill tokens next to decodes: capped (prefill_cap, set by the engine's step budget) so a
        # step that carries decode rows stays short; not in a burst of arrivals (burst.py)
        decodes = sum(len(r.token_ids) - r.num_computed_tokens == 1 for r in self.running)
        self.burst.update(self.running, self.waiting, decodes, self._order, self._next_order)
        cap = None if self.burst.active or not decodes else self.prefill_cap
        if cap is not None and cap < tokens:
            out.prefill_cap = cap = max(1, cap)
        else:
            cap = tokens
        # [tokens, logits rows, prefill tokens] left in this step
        budget = [tokens, self.config.max_num_logit_rows or self.config.max_num_seqs, cap]
        if self.config.prefill_first:
            self._schedule_waiting(out, budget)
            self._schedule_running(out, budget, skip={s.request.request_id for s in out.scheduled})
        elif self.burst.active and self.config.burst_prefill_first:  # prefill chunks alone (burst.py)
            self._schedule_running(out, budget, skip=set(), decodes=False)
            self._schedule_waiting(out, budget)
            if not out.scheduled:  # no chunk could go (memory, sequence cap): the decodes run
                self._schedule_running(out, budget, skip=set())
        else:
            self._schedule_running(out, budget, skip=set())
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        for s in out.scheduled:
            if s.request.first_scheduled_step < 0:
                s.request.first_scheduled_step = self.step
        self.growth.update(bool(out.preempted), self.running)
        self.num_scheduled_tokens += out.num_batched_tokens
        self.step += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: list[int], skip: set[str], decodes: bool = True) -> None:
        """The running requests' prefill chunks and decodes (`decodes=False`: their chunks only)."""
        allocate, scheduled, running = self.kv.allocate, out.scheduled, RequestStatus.RUNNING
        for req in list(self.running):
            if budget[0] <= 0:
                break
            if req.status != running or req.request_id in skip:
                continue  # preempted earlier in this loop, or admitted this step already
            num_tokens = len(req.token_ids)
            if not decodes and num_tokens - req.num_computed_tokens == 1:
                continue
            if req.reached_length or num_tokens >= self.config.max_model_len:
                continue  # its last token is in flight: it ends when that lands
            num_new = min(num_tokens - req.num_computed_tokens, budget[0])
            if num_new > 1:  # a prefill chunk
                num_new = min(num_new, budget[2])
            num_new = self._fit_rows(req, req.num_computed_tokens, num_new, budget)
            if num_new <= 0:
                continue  # waiting for the engine to append its sampled token, or no logits row / prefill left
            draft = self._fit_draft(req, num_new, budget)
            if draft and not allocate(req, num_new + draft):
                draft = 0  # no room for the drafts' slots: decode without them, never preempt for them
            if draft:
                scheduled.append(ScheduledRequest(req, num_new + draft, req.num_computed_tokens, num_tokens, draft))
                budget[0] -= num_new + draft
                budget[1] -= 1 + draft
                continue
            while not allocate(req, num_new):
                victim = self._pick_victim()
                if victim is req and len(self.running) == 1:
                    self._finish_too_long(req, out)
                    break
                self._preempt(victim, out, budget)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens, num_tokens))
                budget[0] -= num_new
                if num_tokens - req.num_computed_tokens > 1:
                    budget[2] -= num_new
                budget[1] -= self._logit_rows(req, req.num_computed_tokens, num_new)

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        if not len(self.waiting) or out.preempted:
            return  # after a preemption, admitting new work would only thrash (as vLLM)
        bs, conservative = self.config.block_size, self.config.admission == "conservative"
        reserve = self._watermark_blocks
        if conservative:
            reserve += self.growth.expected_growth(self.running, bs, self.config.max_model_len)
        admitted: list[Request] = []
        for req in self.waiting.ordered(self.running, self.step):
            if budget[0] <= 0 or budget[2] <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            # fresh: an admission before may have evicted blocks
            hits = [] if req.score_prompt else self.kv.match(req)
            if self.waiting.should_defer(req, len(hits)):
                continue
            cached = len(hits) * bs
            num_new = self._fit_rows(req, cached, min(req.num_tokens - cached, budget[0], budget[2]), budget)
            if num_new <= 0:
                break
            grow = self.growth.expected_growth([req], bs, self.config.max_model_len,
                                               held=cdiv(cached + num_new, bs)) if conservative else 0
            # the first request into an empty batch goes in on its prompt alone: none waits forever
            own = grow if self.running else 0
            if not self.kv.allocate(req, num_new, hits, reserve=reserve + own):
                break  # head of line waits for memory; running requests are never preempted for it
            reserve += grow
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            self.waiting.note_admitted(req, cached)
            out.scheduled.append(ScheduledRequest(req, num_new, cached))
            budget[0] -= num_new
            budget[1] -= self._logit_rows(req, cached, num_new)
            budget[2] -= num_new
        self.waiting.remove_many(admitted)
        self.waiting.age(bool(admitted))

    @staticmethod
    def _logit_rows(req: Request, start: int, num_new: int) -> int:
        """Logits rows of computing tokens [start, start + num_new): one per token of a prompt
        being scored, else one if the chunk reaches the last token (it samples)."""
        if req.score_prompt:
            return num_new
        return 1 if start + num_new == req.num_tokens else 0

    def _fit_rows(self, req: Request, start: int, num_new: int, budget: list[int]) -> int:
        """num_new cut to the logits rows left (0: the request waits for the next step)."""
        if req.score_prompt:
            return min(num_new, budget[1])
        return num_new if budget[1] >= self._logit_rows(req, start, num_new) else 0

    def _fit_draft(self, req: Request, num_new: int, budget: list[int]) -> int:
        """How many of the request's drafts this step verifies: all that fit the token and
        logits-row budgets and max_model_len (a decode row only)."""
        if not req.spec_token_ids or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        room = self.config.max_model_len - req.num_tokens  # the last draft's position < max_model_len
        return max(0, min(len(req.spec_token_ids), budget[0] - 1, budget[1] - 1, room))

    def _victim_key(self, req: Request) -> tuple:
        prio = req.priority if self.config.policy == "priority" else 0
        return (prio, req.arrival_time, self._order[req.request_id])

    def _pick_victim(self) -> Request:
        return max(self.running, key=self._victim_key)

    def _preempt(self, req: Request, out: SchedulerOutput, budget: list[int]) -> None:
        """Recompute later: free blocks (full ones stay cached), back to the front of the queue."""
        self.running.remove(req)
        for i, s in enumerate(out.scheduled):
            if s.request is req:
                budget[0] += s.num_new_tokens
                budget[1] += self._logit_rows(req, s.start, s.num_new_tokens)
                if s.num_tokens - s.start > 1:
                    budget[2] += s.num_new_tokens
                del out.scheduled[i]
                break
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)
        out.preempted.append(req)

    def _finish_too_long(self, req: Request, out: SchedulerOutput) -> None:
        self.finish_request(req, RequestStatus.FINISHED_LENGTH)
        out.finished.append(req)

    # ---- after the step ---------------------------------------------------------------------
    def dispatched(self, out: SchedulerOutput) -> None:
        """The step's batch is built and on its way: its tokens count as computed, and each row
        that samples holds a PENDING token until `update_from_output` brings the real one. The
        next step can be scheduled at once (overlap).

        The full blocks this step writes are cached now, not when it lands (`KVManager.commit`):
        steps run on the device in dispatch order, so a later step that reuses them reads them
        written. Cached only on landing, a prefix whose last chunk is on the device would be missed
        by the next step's admissions and computed again (a burst of 32 prompts over 8 shared
        256-token prefixes: 4,608 prompt tokens computed instead of 4,096)."""
        for s in out.scheduled:
            req = s.request
            assert req.num_computed_tokens == s.start, "dispatched() applied twice?"
            # drafts count as computed once accepted (update_from_output)
            req.num_computed_tokens += s.num_new_tokens - s.num_draft
            if s.samples:
                req.append_token(PENDING)
            self.kv.commit(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> dict[str, Landed]:
        """A dispatched step's sampled tokens land: each replaces its PENDING placeholder (a
        verifying row brings its accepted drafts and one more token: a list, whose drafts' K/V
        is then computed), newly full blocks are cached, and token-level stops (EOS, stop ids,
        max_tokens, max_model_len) finish requests here, dropping what followed the stop.
        Returns, per request that sampled (and was not already finished), what it kept and the
        stop it applied. Every row that samples must bring its tokens."""
        landed: dict[str, Landed] = {}
        max_len = self.config.max_model_len
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue  # aborted, or stopped by a token of an earlier step
            stop = None
            if s.samples:
                index = s.num_tokens  # where dispatched() put the placeholder
                toks = sampled[req.request_id]
                toks = [toks] if isinstance(toks, int) else toks
                kept = landed[req.request_id] = Landed([])
                for i, tok in enumerate(toks):
                    if i == 0:
                        req.token_ids[index] = tok
                    else:
                        req.append_token(tok)
                        req.num_computed_tokens += 1  # the accepted draft before it has K/V
                    kept.tokens.append(tok)
                    stop = req.stop_for(index + i, max_len)
                    if stop is not None:
                        del req.token_ids[index + i + 1:]  # a token sampled after the stop never counts
                        kept.stop = stop
                        break
            if req.status == RequestStatus.RUNNING:
                self.kv.commit(req)
            if stop is not None:
                self.finish_request(req, stop[0])
        return landed

    # ---- numbers ------------------------------------------------------------------------------
    def stats(self) -> dict:
        st, kv = self.kv.stats, self.kv
        cached = kv.cache.num_evictable
        free = kv.num_free_blocks
        return {
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "prefix_cache_hit_blocks": st.hit_blocks,
            "hit_rate": st.hits / st.queries if st.queries else 0.0,
            "evictions": st.evictions,
            "preemptions": self.num_preemptions,
            "num_blocks": kv.num_blocks,
            "blocks_free": free,
            "blocks_cached": cached,
            "blocks_used": kv.num_blocks - 1 - free - cached,
            "num_computed_prompt_tokens": self.num_scheduled_tokens,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "steps": self.step,
        }
