"""The step contract, host side: a scheduler plan in, one `StepBatch` out (numpy, no jax).

    Scheduler.schedule() -> [RowSpec per scheduled row] -> BatchBuilder.build() -> StepBatch
    StepBatch.pack() -> one int32 buffer (a multi-host leader broadcasts it) -> its head to the
        bucket's forward, its tail (SAMPLER_FIELDS on: shaped by S and W alone) to the shared sampler

A batch's shapes are fixed by its `BucketKey` (T tokens, S sequences, W adjustment entries per
row: 0, a small width for logit bias / bans / short penalties, or one that holds any request's
every token); everything that varies per step is a value. A bucket with W > 0 also carries the
structured-output token bitmask (i32[S, ceil(V/32)]; -1 = unconstrained). T and S are chosen independently: S is 1 for a
step of one sequence (a lone prefill or a single stream), else the T bucket's sequence width.
Where the attention backend's work spans the block table (the `xla` path), the table's width C is
a bucket dimension too (buckets.py); elsewhere C = 0, the full `max_blocks` width.

Logits rows: S counts sequences (attention's seq_lens, block tables) and, separately, logits rows
(sampling parameters, `logits_indices`): a row samples its last token and may ask for logits at
earlier tokens too (`RowSpec.extra`: speculative verification, prompt logprobs). Such a logits row
verifies the row's next input token (`verify_ids`): the sampler says whether its distribution
accepts that token (rejection sampling) and returns its logprob.

Overlap: a row whose last token is still being sampled by the step in flight carries the token id
PENDING and `prev_index` = its row in that step; the executable takes the token from the previous
step's device output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .buckets import (ADJUST_MIN_TOKENS, SINGLE_SEQ_MIN_TOKENS, BucketKey, context_widths, covering_bucket,
                      next_pow2, token_buckets)
from .request import PENDING

MAX_LOGPROBS = 20  # top-N logprobs every executable can return (OpenAI's and vLLM's limit)
MAX_EXTRA_ADJUSTMENTS = 512  # logit_bias + stop-token bans per request, on top of its tokens
SMALL_ADJUSTMENTS = 512  # the narrow adjustment width: bias, bans, structured rows


class StepBatch(NamedTuple):
    """One step's inputs; shapes fixed by the bucket. Padding tokens write to the null block 0;
    padding sequences have no tokens and sample nothing."""

    input_ids: np.ndarray  # i32[T] (PENDING: take prev_tokens[prev_index])
    prev_index: np.ndarray  # i32[T] row of the previous step's tokens, or -1
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T] flat KV slot each token writes
    seq_lens: np.ndarray  # i32[S] context length incl. this step's tokens (0 for padding)
    query_start_loc: np.ndarray  # i32[S+1]
    block_tables: np.ndarray  # i32[S, C] (C = key.c, or max_blocks where c is 0)
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S] token row of each logits row
    num_logits: np.ndarray  # i32[1] logits rows in use (the LM head computes only these)
    # the sampler's fields (SAMPLER_FIELDS: shaped by S and W alone)
    verify_ids: np.ndarray  # i32[S] token the logits row verifies (the next input token), or -1
    temperature: np.ndarray  # f32[S] (0 = greedy)
    top_k: np.ndarray  # i32[S] (0 = off)
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    seed_lo: np.ndarray  # u32[S] low half of the row's 64-bit seed
    seed_hi: np.ndarray  # u32[S] high half
    steps: np.ndarray  # i32[S] output index of the token being sampled
    num_logprobs: np.ndarray  # i32[S] top-N logprobs wanted (-1: none)
    logprob_ids: np.ndarray  # i32[S, MAX_LOGPROBS] ids whose logprobs replace the top-N (-1 pad; all -1: top-N)
    presence: np.ndarray  # f32[S]
    frequency: np.ndarray  # f32[S]
    repetition: np.ndarray  # f32[S]
    adj_ids: np.ndarray  # i32[S, W] token ids to adjust (-1 pad); unique per row
    adj_out_counts: np.ndarray  # f32[S, W] times the token was generated
    adj_in_prompt: np.ndarray  # f32[S, W] 1 if the token is in the prompt
    adj_bias: np.ndarray  # f32[S, W] added last (logit_bias; -inf bans EOS before min_tokens)
    bitmask: np.ndarray  # i32[S, M] allowed tokens, bit j of word i = token 32i+j (M = 0 if W = 0)

    def pack(self) -> np.ndarray:
        """All fields as one flat int32 buffer (floats and unsigned ints by bit pattern)."""
        return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in self])


def field_specs(key: BucketKey, max_blocks: int, mask_words: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each StepBatch field for a bucket, in pack order."""
    t, s, w = key[:3]
    dims = {"T": (t,), "S": (s,), "S+1": (s + 1,), "SB": (s, key.c or max_blocks), "1": (1,), "SW": (s, w),
            "SM": (s, mask_words if w else 0), "SL": (s, MAX_LOGPROBS)}
    return [(name, dims[d], dt) for name, d, dt in _FIELDS]


_FIELDS = (
    ("input_ids", "T", "int32"), ("prev_index", "T", "int32"), ("positions", "T", "int32"),
    ("slot_mapping", "T", "int32"), ("seq_lens", "S", "int32"), ("query_start_loc", "S+1", "int32"),
    ("block_tables", "SB", "int32"), ("num_seqs", "1", "int32"), ("logits_indices", "S", "int32"),
    ("num_logits", "1", "int32"), ("verify_ids", "S", "int32"),
    ("temperature", "S", "float32"), ("top_k", "S", "int32"), ("top_p", "S", "float32"),
    ("min_p", "S", "float32"), ("seed_lo", "S", "uint32"), ("seed_hi", "S", "uint32"),
    ("steps", "S", "int32"), ("num_logprobs", "S", "int32"), ("logprob_ids", "SL", "int32"),
    ("presence", "S", "float32"),
    ("frequency", "S", "float32"), ("repetition", "S", "float32"), ("adj_ids", "SW", "int32"),
    ("adj_out_counts", "SW", "float32"), ("adj_in_prompt", "SW", "float32"),
    ("adj_bias", "SW", "float32"), ("bitmask", "SM", "int32"),
)
assert tuple(f[0] for f in _FIELDS) == StepBatch._fields
SAMPLER_FIELDS = StepBatch._fields.index("verify_ids")  # the fields from here on are the sampler's


@dataclass(slots=True)
class Sampling:
    """What one row samples with (the subset of SamplingParams the device sees)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # 64-bit
    step: int = 0  # output index of the token this row samples
    num_logprobs: int = -1
    logprob_ids: tuple[int, ...] = ()  # named ids in place of the top-N (vLLM's logprob_token_ids)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] = field(default_factory=dict)  # incl. -inf bans
    prompt_tokens: frozenset | set = frozenset()  # for the repetition penalty
    output_counts: dict[int, int] = field(default_factory=dict)  # for all three penalties
    constrained: bool = False  # under a grammar: the engine fills its bitmask row

    @property
    def adjusts(self) -> bool:
        return bool(self.bias) or self.uses_penalties or self.constrained

    def num_adjustments(self) -> int:
        """An upper bound of len(adjustments()), without building it."""
        n = len(self.bias)
        if self.uses_penalties:
            n += len(self.output_counts) + (len(self.prompt_tokens) if self.repetition != 1.0 else 0)
        return n

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    def adjustments(self) -> dict[int, tuple[float, float, float]]:
        """token -> (output count, in prompt, bias), only where the logit changes."""
        out: dict[int, tuple[float, float, float]] = {}
        if self.uses_penalties:
            for tok, n in self.output_counts.items():
                out[tok] = (float(n), 0.0, 0.0)
            if self.repetition != 1.0:
                for tok in self.prompt_tokens:
                    n = out.get(tok, (0.0, 0.0, 0.0))[0]
                    out[tok] = (n, 1.0, 0.0)
        for tok, b in self.bias.items():
            n, p, _ = out.get(tok, (0.0, 0.0, 0.0))
            out[tok] = (n, p, b)
        return out


@dataclass(slots=True)
class RowSpec:
    """One scheduled row: compute tokens [start, start + num_new) of `token_ids`."""

    token_ids: list[int]
    start: int
    num_new: int
    block_ids: list[int]
    sampling: Sampling | None = None  # None: this row does not sample (a prefill chunk)
    prev_index: int = -1  # the logits row of the step in flight that samples token_ids[-1] (PENDING)
    # Logits rows before the last token: (offset into this step's tokens, sampling); each verifies
    # token_ids[start + offset + 1] (a draft to accept or a prompt token to score); an offset can
    # be num_new - 1 only in a row that does not sample.
    extra: list[tuple[int, Sampling]] = field(default_factory=list)

    @property
    def num_logit_rows(self) -> int:
        return len(self.extra) + (self.sampling is not None)


class RowMap(NamedTuple):
    """Where build() put each row's logits rows (its extra rows come first, then its last token's)."""

    first: list[int]  # per row: its first logits row
    out: list[int]  # per row: the logits row of its last token, or -1 where it does not sample


class BatchBuilder:
    """Chooses the bucket and fills a StepBatch. Jax-free, so it is unit-tested on its own."""

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                 max_model_len: int, vocab_size: int, decode_buckets: bool = False,
                 context_buckets: bool = False):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.t_buckets = token_buckets(max_num_batched_tokens)
        self.s_max = next_pow2(max_num_seqs)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.mask_words = (vocab_size + 31) // 32
        # Every token a request holds (its prompt and output) plus its bias entries fits a row.
        self.max_adjustments = next_pow2(min(max_model_len, vocab_size) + MAX_EXTRA_ADJUSTMENTS)
        self.adjust_widths = sorted({min(SMALL_ADJUSTMENTS, self.max_adjustments), self.max_adjustments})
        self.decode_buckets = decode_buckets
        self.context_buckets = context_buckets
        self.ready = None  # the buckets steps may use while others compile (covering_bucket); None: all

    @property
    def context_buckets(self) -> bool:
        return bool(self.context_widths)

    def set_token_midpoints(self, on: bool) -> None:
        """T buckets at the 1.5x midpoints too, or not (the backend's choice: Backend.token_midpoints)."""
        self.t_buckets = token_buckets(self.max_num_batched_tokens, midpoints=on)

    @context_buckets.setter
    def context_buckets(self, on: bool) -> None:
        """Block-table widths as a bucket dimension (the backend's choice; a fallback may change it)."""
        self.context_widths = context_widths(self.max_blocks) if on else []

    # ---- buckets ----------------------------------------------------------------------------
    def seq_bucket(self, t: int) -> int:
        """The sequence width of a multi-sequence step of T bucket t."""
        return min(t, self.s_max)

    def _t(self, num_tokens: int) -> int:
        return next(b for b in self.t_buckets if b >= min(num_tokens, self.t_buckets[-1]))

    def _min_tokens(self, w: int) -> int:
        return ADJUST_MIN_TOKENS[0] if w == self.adjust_widths[0] else ADJUST_MIN_TOKENS[1]

    def context_bucket(self, context_blocks: int) -> int:
        """The table width C of a step whose longest context spans `context_blocks` blocks: the
        smallest context width that holds it, or 0 (the full width) without context buckets."""
        if not self.context_widths:
            return 0
        return next((c for c in self.context_widths if c >= context_blocks), self.context_widths[-1])

    def table_width(self, key: BucketKey) -> int:
        return key.c or self.max_blocks

    def bucket_for(self, num_tokens: int, num_seqs: int, adjustments: int = -1, logit_rows: int = 1,
                   context_blocks: int = 0) -> BucketKey:
        """adjustments: the most sparse entries a row needs (-1: no row adjusts anything);
        logit_rows: logits rows in the step (at most num_tokens and s_max); context_blocks: the
        longest sequence's context (this step's tokens included) in blocks."""
        c = self.context_bucket(context_blocks)
        return self._bucket(num_tokens, num_seqs, adjustments, logit_rows)._replace(c=c)

    def _bucket(self, num_tokens: int, num_seqs: int, adjustments: int, logit_rows: int) -> BucketKey:
        if logit_rows > self.s_max:
            raise ValueError(f"{logit_rows} logits rows exceed the step's {self.s_max}")
        if adjustments < 0:
            t = self._t(num_tokens)
            lone = max(num_seqs, logit_rows) == 1 and t >= SINGLE_SEQ_MIN_TOKENS
            return BucketKey(t, 1 if lone else self.seq_bucket(t), 0)
        w = next((w for w in self.adjust_widths if w >= adjustments), None)
        if w is None:
            raise ValueError(f"{adjustments} logit adjustments exceed the widest row ({self.max_adjustments})")
        t = self._t(max(num_tokens, self._min_tokens(w)))
        return BucketKey(t, self.seq_bucket(t), w)

    def all_buckets(self) -> list[BucketKey]:
        """Every bucket a step can use: (T, S(T), 0), (T, 1, 0) from SINGLE_SEQ_MIN_TOKENS, and
        (T, S(T), W) for each width W from its minimum T; each at every context width C."""
        keys = set()
        for t in self.t_buckets:
            keys.add(BucketKey(t, self.seq_bucket(t), 0))
            if t >= SINGLE_SEQ_MIN_TOKENS:
                keys.add(BucketKey(t, 1, 0))
            keys.update(BucketKey(t, self.seq_bucket(t), w) for w in self.adjust_widths
                        if t >= min(self._min_tokens(w), self.t_buckets[-1]))
        if self.decode_buckets:  # a decode step's T is its sequence count
            keys.update(k._replace(decode=True) for k in list(keys) if k.t == k.s and k.t <= self.s_max)
        if self.context_widths:
            keys = {k._replace(c=c) for k in keys for c in self.context_widths}
        return sorted(keys)

    def field_specs(self, key: BucketKey) -> list[tuple[str, tuple[int, ...], str]]:
        return field_specs(key, self.max_blocks, self.mask_words)

    def packed_size(self, key: BucketKey) -> int:
        return sum(int(np.prod(shape)) for _, shape, _ in self.field_specs(key))

    # ---- one step ---------------------------------------------------------------------------
    def build(self, rows: list[RowSpec]) -> tuple[StepBatch, BucketKey, RowMap]:
        """Decode rows should come first (the xla attention takes them in a loop of their own).
        The rows are not changed; the RowMap says where each one's logits rows went. Per-token and
        per-row fields are filled with whole-array numpy operations: the Python loop touches each
        row once."""
        num_rows = len(rows)
        lens = np.fromiter((r.num_new for r in rows), np.int64, num_rows)
        starts = np.fromiter((r.start for r in rows), np.int64, num_rows)
        offsets = np.zeros(num_rows + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        n = int(offsets[-1])
        # logits rows in order: each row's extra rows, then its last token's (when it samples)
        logit_tok, verify, samplings = [], [], []
        rowmap = RowMap([], [])
        for i, r in enumerate(rows):
            rowmap.first.append(len(samplings))
            if r.extra:
                last = r.num_new - 1 if r.sampling is not None else r.num_new
                for offset, p in r.extra:
                    assert 0 <= offset < last and r.start + offset + 1 < len(r.token_ids), offset
                    tok = r.token_ids[r.start + offset + 1]
                    assert tok != PENDING, "a verified token is known"
                    logit_tok.append(int(offsets[i]) + offset)
                    verify.append(tok)
                    samplings.append(p)
            if r.sampling is not None:
                rowmap.out.append(len(samplings))
                logit_tok.append(int(offsets[i + 1]) - 1)
                verify.append(-1)
                samplings.append(r.sampling)
            else:
                rowmap.out.append(-1)
        need = max((p.num_adjustments() for p in samplings if p.adjusts), default=-1)
        bs = self.block_size
        context = int((starts + lens).max(initial=0))
        key = self.bucket_for(n, num_rows, need, len(samplings), -(-context // bs))
        if self.decode_buckets and n == num_rows and key.t == key.s:
            key = key._replace(decode=True)
        if self.ready is not None and key not in self.ready:  # still compiling: a compiled bucket that holds it
            key = covering_bucket(key, self.ready, self.max_blocks) or key
        w = key.w
        b = self.empty(key)
        # tokens
        if n == num_rows:  # one token per row (decode): no slicing
            b.input_ids[:n] = [r.token_ids[r.start] for r in rows]
        else:
            b.input_ids[:n] = [t for r in rows for t in r.token_ids[r.start:r.start + r.num_new]]
        pending = np.flatnonzero(b.input_ids[:n] == PENDING)
        if pending.size:
            row = np.searchsorted(offsets, pending, side="right") - 1
            for tok, i in zip(pending.tolist(), row.tolist()):
                r = rows[i]
                assert tok == offsets[i + 1] - 1, "only a row's last token can be pending"
                assert r.prev_index >= 0 and r.start + r.num_new == len(r.token_ids), "a pending token is always last"
                b.prev_index[tok] = r.prev_index
        tok_row = np.repeat(np.arange(num_rows), lens)
        pos = np.arange(n) - offsets[:-1][tok_row] + starts[tok_row]
        b.positions[:n] = pos
        width = b.block_tables.shape[1]  # a context bucket's C >= every row's blocks in use
        for i, r in enumerate(rows):
            ids = r.block_ids[:width]
            b.block_tables[i, :len(ids)] = ids
        b.slot_mapping[:n] = b.block_tables[tok_row, pos // bs] * bs + pos % bs
        b.seq_lens[:num_rows] = starts + lens
        b.query_start_loc[1:num_rows + 1] = offsets[1:]
        b.query_start_loc[num_rows + 1:] = n
        b.num_seqs[0] = num_rows
        # logits rows
        m = len(samplings)
        b.logits_indices[:m] = logit_tok
        b.logits_indices[m:] = max(n - 1, 0)
        b.verify_ids[:m] = verify
        b.num_logits[0] = m
        if m:
            self._fill_samplings(b, samplings, w)
        return b, key, rowmap

    @staticmethod
    def _fill_samplings(b: StepBatch, samplings: list[Sampling], w: int) -> None:
        m = len(samplings)
        for name, attr in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                           ("min_p", "min_p"), ("steps", "step"), ("num_logprobs", "num_logprobs"),
                           ("presence", "presence"), ("frequency", "frequency"), ("repetition", "repetition")):
            getattr(b, name)[:m] = [getattr(p, attr) for p in samplings]
        seeds = np.fromiter((p.seed & 0xFFFFFFFFFFFFFFFF for p in samplings), np.uint64, m)
        b.seed_lo[:m] = seeds & 0xFFFFFFFF
        b.seed_hi[:m] = seeds >> np.uint64(32)
        for i, p in enumerate(samplings):
            if p.logprob_ids:
                b.logprob_ids[i, :len(p.logprob_ids)] = p.logprob_ids
        if not w:
            return
        for i, p in enumerate(samplings):
            if not p.adjusts:
                continue
            adj = p.adjustments()
            if len(adj) > w:
                raise ValueError(f"{len(adj)} logit adjustments exceed the row width {w}")
            k = len(adj)
            b.adj_ids[i, :k] = list(adj)
            vals = np.asarray(list(adj.values()), np.float32).reshape(k, 3)
            b.adj_out_counts[i, :k] = vals[:, 0]
            b.adj_in_prompt[i, :k] = vals[:, 1]
            b.adj_bias[i, :k] = vals[:, 2]

    def empty(self, key: BucketKey) -> StepBatch:
        t, s, w = key[:3]
        z = lambda shape, dt=np.int32, v=0: np.full(shape, v, dt)  # noqa: E731
        return StepBatch(
            input_ids=z(t), prev_index=z(t, v=-1), positions=z(t), slot_mapping=z(t),
            seq_lens=z(s), query_start_loc=z(s + 1), block_tables=z((s, self.table_width(key))),
            num_seqs=z(1), logits_indices=z(s), num_logits=z(1), verify_ids=z(s, v=-1), temperature=z(s, np.float32),
            top_k=z(s), top_p=z(s, np.float32, 1.0), min_p=z(s, np.float32),
            seed_lo=z(s, np.uint32), seed_hi=z(s, np.uint32), steps=z(s), num_logprobs=z(s, v=-1),
            logprob_ids=z((s, MAX_LOGPROBS), v=-1),
            presence=z(s, np.float32), frequency=z(s, np.float32), repetition=z(s, np.float32, 1.0),
            adj_ids=z((s, w), v=-1), adj_out_counts=z((s, w), np.float32),
            adj_in_prompt=z((s, w), np.float32), adj_bias=z((s, w), np.float32),
            bitmask=z((s, self.mask_words if w else 0), v=-1),
        )
