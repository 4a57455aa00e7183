"""The scheduler's knobs (`SchedulerConfig`, checked when made) and their choices; the admission
policies are described in scheduler.py."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError

PREFIX_CACHES = ("radix", "hash", "off")
EVICTIONS = ("lru", "trunk")
POLICIES = ("fcfs", "priority", "lpm")
ADMISSIONS = ("optimistic", "conservative")


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int  # total, including the reserved null block 0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    prefix_cache: str = "radix"  # radix | hash | off
    eviction: str = "lru"  # lru | trunk
    policy: str = "fcfs"  # fcfs | priority | lpm
    prefill_first: bool = False  # False: running requests (decodes) are scheduled first
    # in a burst of arrivals (as many requests wait for their first token as decode), prefill chunks
    # first and decodes take what budget is left (burst.py)
    burst_prefill_first: bool = True
    lpm_max_wait_steps: int = 32  # lpm aging: after this many passed-over steps, serve in fcfs order
    lpm_max_queue: int = 128  # lpm falls back to fcfs above this many waiting requests
    # admission keeps this fraction of blocks free for running requests to grow (vLLM V0's watermark)
    watermark: float = 0.01
    admission: str = "optimistic"  # optimistic | conservative (see the module docstring)
    init_new_token_ratio: float = 0.7  # conservative: share of max_tokens expected still to come
    dedup_in_batch: bool = True  # defer a request whose uncached prefix another one is computing
    hash_seed: int = 0
    # logits rows per step (0: max_num_seqs): a sampling row takes one, a prompt-logprobs prefill one
    # per token; the engine sets what its step buckets hold
    max_num_logit_rows: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise UserError(f"SchedulerConfig.{name}={getattr(self, name)!r}: {fix}")

        need(self.num_blocks >= 2, "num_blocks", "need at least 2 (block 0 is the reserved null block)")
        need(self.block_size >= 1, "block_size", "must be a positive number of tokens, e.g. 16")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1")
        need(self.max_model_len >= 2, "max_model_len", "must be at least 2 tokens")
        need(self.prefix_cache in PREFIX_CACHES, "prefix_cache", f"choose one of {PREFIX_CACHES}")
        need(self.eviction in EVICTIONS, "eviction", f"choose one of {EVICTIONS}")
        need(self.policy in POLICIES, "policy", f"choose one of {POLICIES}")
        need(self.lpm_max_wait_steps >= 0, "lpm_max_wait_steps", "must be >= 0")
        need(self.lpm_max_queue >= 0, "lpm_max_queue", "must be >= 0")
        need(0 <= self.watermark < 1, "watermark", "must be a fraction in [0, 1)")
        need(self.admission in ADMISSIONS, "admission", f"choose one of {ADMISSIONS}")
        need(0 <= self.init_new_token_ratio <= 1, "init_new_token_ratio", "must be a fraction in [0, 1]")
        need(self.max_num_logit_rows in (0,) or self.max_num_logit_rows >= self.max_num_seqs,
             "max_num_logit_rows", "must be 0 (max_num_seqs) or at least max_num_seqs")
