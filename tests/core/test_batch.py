"""The jax-free batch builder: bucket choice (T and S independent), row layout, padding, sampling
arrays of fixed width per bucket, and the single packed buffer."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.batch import PENDING, BatchBuilder, RowSpec, Sampling, StepBatch
from jaxserve.core.buckets import BucketKey
from jaxserve.core.buckets import CONTEXT_MIN_BLOCKS, MAX_CONTEXT_WIDTHS, context_widths


def builder(**kw) -> BatchBuilder:
    args = dict(max_num_batched_tokens=64, max_num_seqs=16, block_size=4, max_model_len=64, vocab_size=100)
    return BatchBuilder(**{**args, **kw})


def test_buckets_are_independent_in_tokens_and_sequences():
    b = builder()
    assert b.bucket_for(40, 1) == BucketKey(48, 1, 0)  # one long prefill: one logits row
    assert b.bucket_for(40, 5) == BucketKey(48, 16, 0)
    assert b.bucket_for(3, 3) == BucketKey(4, 4, 0)
    assert b.bucket_for(1, 1) == BucketKey(1, 1, 0)
    small, full = b.adjust_widths
    assert (small, full) == (512, b.max_adjustments) == (512, 1024)
    assert b.bucket_for(40, 1, adjustments=3) == BucketKey(48, 16, small)  # bias, bans, grammars: narrow
    assert b.bucket_for(40, 3, adjustments=600) == BucketKey(64, 16, full)  # long penalties: wide, T >= 64
    assert b.bucket_for(1, 1, adjustments=0) == BucketKey(8, 8, small)  # padded to 8 tokens
    with pytest.raises(ValueError, match="exceed"):
        b.bucket_for(40, 3, adjustments=full + 1)
    assert set(b.all_buckets()) >= {b.bucket_for(n, s, a) for n in range(1, 65) for s in range(1, min(n, 16) + 1)
                                    for a in (-1, 0, 600)}
    assert len(b.all_buckets()) == len(set(b.all_buckets()))


def test_rows_padding_and_slots():
    b = builder()
    rows = [RowSpec([9, 8, 7, 6, 5], 4, 1, [3, 2], Sampling(temperature=0.5, seed=2**63 + 5, step=1)),
            RowSpec([1, 2, 3, 4, 5, 6], 0, 6, [7, 8], None)]
    batch, key, _ = b.build(rows)
    assert key == BucketKey(8, 8, 0)
    assert batch.input_ids.tolist() == [5, 1, 2, 3, 4, 5, 6, 0]
    assert batch.positions.tolist() == [4, 0, 1, 2, 3, 4, 5, 0]
    assert batch.slot_mapping.tolist() == [2 * 4 + 0, 28, 29, 30, 31, 32, 33, 0]  # padding -> null block
    assert batch.query_start_loc.tolist() == [0, 1, 7, 7, 7, 7, 7, 7, 7]
    assert batch.seq_lens.tolist()[:3] == [5, 6, 0] and batch.num_seqs.tolist() == [2]
    assert batch.logits_indices.tolist()[:2] == [0, 6]
    assert batch.block_tables[0, :2].tolist() == [3, 2] and batch.block_tables[2].sum() == 0
    assert batch.temperature[0] == np.float32(0.5) and batch.temperature[1] == 0  # a prefill chunk samples nothing
    assert int(batch.seed_lo[0]) == 5 and int(batch.seed_hi[0]) == 2**31  # all 64 bits of the seed
    assert batch.prev_index.tolist() == [-1] * 8


def test_pending_token_reads_the_previous_step():
    batch, _, _ = builder().build([RowSpec([4, 5, PENDING], 2, 1, [1], Sampling(), prev_index=3)])
    assert batch.input_ids[0] == PENDING and batch.prev_index.tolist() == [3]
    with pytest.raises(AssertionError):
        builder().build([RowSpec([4, PENDING, 6], 0, 3, [1], None)])


def test_adjustments_are_sparse_unique_and_fixed_width():
    b = builder()
    s = Sampling(temperature=0, repetition=1.2, frequency=0.5, prompt_tokens={4, 5}, output_counts={5: 2, 9: 1},
                 bias={9: 3.0, 11: -np.inf})
    batch, key, _ = b.build([RowSpec([4, 5, 5, 9, 5], 4, 1, [1, 2], s)])
    assert key.w == 512 and batch.adj_ids.shape == (key.s, key.w)
    assert batch.bitmask.shape == (key.s, 4) and (batch.bitmask == -1).all()  # 100 tokens: 4 words, all allowed
    got = {int(t): (c, p, bias) for t, c, p, bias in zip(batch.adj_ids[0], batch.adj_out_counts[0],
                                                           batch.adj_in_prompt[0], batch.adj_bias[0]) if t >= 0}
    assert got == {4: (0, 1, 0), 5: (2, 1, 0), 9: (1, 0, 3.0), 11: (0, 0, -np.inf)}
    assert (batch.adj_ids[1:] == -1).all()
    plain, key0, _ = b.build([RowSpec([4, 5], 1, 1, [1], Sampling(repetition=1.0, temperature=1.0))])
    assert key0.w == 0 and plain.adj_ids.shape == (1, 0) and plain.bitmask.shape == (1, 0)  # neutral: free
    _, keyc, _ = b.build([RowSpec([4, 5], 1, 1, [1], Sampling(constrained=True))])
    assert keyc.w == 512  # a grammar row takes the narrow bucket, which carries the mask


def test_pack_is_one_int32_buffer_in_field_order():
    b = builder()
    batch, key, _ = b.build([RowSpec([1, 2, 3], 0, 3, [1], Sampling(temperature=0.25, top_p=0.5))])
    flat = batch.pack()
    assert flat.dtype == np.int32 and flat.size == b.packed_size(key)
    off = 0
    for (name, shape, dt), value in zip(b.field_specs(key), batch):
        n = int(np.prod(shape))
        assert value.shape == shape and value.dtype == np.dtype(dt), name
        np.testing.assert_array_equal(flat[off:off + n].view(dt).reshape(shape), value)
        off += n
    assert StepBatch._fields[0] == "input_ids"


def test_decode_buckets_where_the_backend_has_a_decode_kernel():
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16, block_size=4, max_model_len=64, vocab_size=100)
    on, off = BatchBuilder(**kw, decode_buckets=True), BatchBuilder(**kw)
    decodes = [RowSpec([1, 2, 3], 2, 1, [1], Sampling()) for _ in range(3)]
    assert on.build(decodes)[1] == BucketKey(4, 4, 0, True) and off.build(decodes)[1] == BucketKey(4, 4, 0, False)
    mixed = decodes + [RowSpec([1, 2, 3], 0, 3, [2], Sampling())]
    assert not on.build(mixed)[1].decode  # a prefill row: the general kernel
    assert not on.build([RowSpec([5, 6, 7, 8], 2, 2, [3], Sampling(), extra=[(0, Sampling())])])[1].decode
    assert {k for k in on.all_buckets() if not k.decode} == set(off.all_buckets())
    assert all(k._replace(decode=False) in off.all_buckets() for k in on.all_buckets())


def test_context_widths_are_few_powers_of_two_up_to_max_blocks():
    assert context_widths(16) == [16] and context_widths(4) == [4]  # one width: the table as it was
    assert context_widths(64) == [16, 32, 64]
    assert context_widths(128) == [16, 32, 64, 128]
    assert context_widths(256) == [16, 64, 256]  # 4096 tokens of 16: spaced by 4 to stay within 4
    assert context_widths(250) == [16, 64, 250]  # capped at max_model_len / block_size
    assert context_widths(8192) == [16, 128, 1024, 8192]  # 128k tokens of 16
    for n in range(1, 20000, 37):
        w = context_widths(n)
        assert len(w) <= MAX_CONTEXT_WIDTHS and w[-1] == n and w == sorted(set(w))
        assert all(c & (c - 1) == 0 and c >= CONTEXT_MIN_BLOCKS for c in w[:-1])


def test_context_buckets_size_the_block_table_to_the_longest_context():
    """With context buckets (the xla backend) the block table is [S, C], C the smallest width that
    holds the step's longest context (this step's tokens included); without, [S, max_blocks], C = 0."""
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16, block_size=4, max_model_len=512, vocab_size=100)
    on, off = BatchBuilder(**kw, context_buckets=True), BatchBuilder(**kw)
    assert on.max_blocks == 128 and on.context_widths == [16, 32, 64, 128] and off.context_widths == []

    def decode(ctx, blocks=None):  # one decode token at position ctx - 1
        return RowSpec(list(range(1, ctx + 1)), ctx - 1, 1, blocks or list(range(1, -(-ctx // 4) + 1)), Sampling())

    batch, key, _ = on.build([decode(10), decode(64)])  # 64 tokens = 16 blocks
    assert key == BucketKey(2, 2, 0, c=16) and batch.block_tables.shape == (2, 16)
    assert batch.block_tables[1].tolist() == list(range(1, 17))
    assert batch.pack().size == on.packed_size(key)
    full, key_off, _ = off.build([decode(10), decode(64)])
    assert key_off == BucketKey(2, 2, 0) and full.block_tables.shape == (2, 128)
    np.testing.assert_array_equal(full.block_tables[:, :16], batch.block_tables)
    assert not full.block_tables[:, 16:].any()
    for name in StepBatch._fields:  # every other field is the same
        if name != "block_tables":
            np.testing.assert_array_equal(getattr(full, name), getattr(batch, name), err_msg=name)
    assert on.build([decode(10), decode(65)])[1].c == 32  # one token more: the next width
    assert on.build([decode(400)])[1].c == 128
    # a prefill chunk counts its own tokens; blocks allocated ahead of the context are not needed
    prefill = RowSpec(list(range(1, 101)), 60, 40, list(range(1, 40)), None)
    batch, key, _ = on.build([prefill])
    assert key.c == 32 and batch.block_tables[0].tolist() == list(range(1, 33))
    assert batch.slot_mapping[:40].tolist() == [(1 + p // 4) * 4 + p % 4 for p in range(60, 100)]
    # every bucket a step can use is listed, at each width; the widths multiply the set
    assert len(on.all_buckets()) == 4 * len(off.all_buckets())
    assert {k._replace(c=0) for k in on.all_buckets()} == set(off.all_buckets())
    assert set(on.all_buckets()) >= {on.bucket_for(n, s, a, context_blocks=cb) for n in (1, 3, 40, 64)
                                     for s in (1, min(n, 16)) for a in (-1, 0) for cb in (0, 1, 16, 17, 100, 128)}
    on.context_buckets = False  # what the runner does when the backend changes
    assert on.all_buckets() == off.all_buckets() and on.build([decode(400)])[1].c == 0


def test_while_buckets_compile_a_step_runs_on_a_compiled_one_that_holds_it():
    b = builder()
    want = b.bucket_for(3, 3)
    largest = max(b.all_buckets())
    b.ready = {largest}
    rows = [RowSpec([1, 2, 3], 2, 1, [0], Sampling()) for _ in range(3)]
    batch, key, _ = b.build(rows)
    assert key == largest and batch.input_ids.shape[0] == largest.t  # padded to the compiled bucket
    b.ready = {largest, BucketKey(8, 8, 0), BucketKey(4, 1, 0)}
    assert b.build(rows)[1] == BucketKey(8, 8, 0)  # the smallest that holds 3 rows (S=1 cannot)
    b.ready = None
    assert b.build(rows)[1] == want
    from jaxserve.core.buckets import covering_bucket

    assert covering_bucket(BucketKey(8, 8, 512), {BucketKey(64, 16, 0)}, 16) is None  # no adjustments there
    assert covering_bucket(BucketKey(8, 8, 0, c=4), {BucketKey(8, 8, 0, c=2), BucketKey(8, 8, 0)}, 16) == \
        BucketKey(8, 8, 0)  # c=0: the full width


def test_without_midpoints_tokens_pad_to_powers_of_two():
    b = builder()
    assert b.bucket_for(20, 20) == BucketKey(24, 16, 0)
    n = len(b.all_buckets())
    b.set_token_midpoints(False)  # the native CPU backend: padding rows are skipped, buckets cost memory
    assert b.t_buckets == [1, 2, 4, 8, 16, 32, 64] and b.bucket_for(20, 20) == BucketKey(32, 16, 0)
    assert len(b.all_buckets()) < n
