import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.block_pool import NULL_BLOCK, BlockPool


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    got = [pool.pop() for _ in range(4)]
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    assert pool.num_free == 0
    pool.check_invariants()


def test_too_small_pool_is_a_clear_error():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)


def test_double_free_is_caught():
    pool = BlockPool(3)
    b = pool.pop()
    assert pool.decref(b)
    pool.push(b)
    with pytest.raises(AssertionError):
        pool.push(b)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.lists(st.tuples(st.sampled_from("pird"), st.integers(0, 50)), max_size=80))
def test_random_ops_keep_the_pool_consistent(n, ops):
    pool = BlockPool(n)
    held: dict[int, int] = {}  # block -> our references
    for op, x in ops:
        if op == "p" and pool.num_free:
            b = pool.pop()
            assert b not in held
            held[b] = 1
        elif op == "i" and held:
            b = sorted(held)[x % len(held)]
            pool.incref(b)
            held[b] += 1
        elif op in "rd" and held:
            b = sorted(held)[x % len(held)]
            held[b] -= 1
            if pool.decref(b):
                assert held.pop(b) == 0
                pool.push(b)
        pool.check_invariants()
        assert pool.num_free + len(held) == n - 1
        assert all(pool.ref_cnt[b] == c for b, c in held.items())
    for b, c in list(held.items()):
        for _ in range(c):
            pool.decref(b)
        pool.push(b)
    assert pool.num_free == n - 1
