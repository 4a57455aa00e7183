"""The native row moves of a packed-expert MoE layer (csrc/moe_rows.cc, runtime/expert_matmul.py
native_route / native_gather / native_combine): the layer's rows reach the experts and come back as with XLA's
gathers, each token's sum over its slots a float32 FMA chain from 0 in slot order (what XLA's
einsum computes at its default optimization; the suite's -O0, conftest.py, leaves mul and add
apart, so the einsum is checked against to within rounding only), for routed-away slots, padded
tokens and experts of another device; the gated grouped call given the order reads the tokens' rows
in sorted order itself, byte for byte the gather then the call, in every format on each instruction
path; a malformed order is refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels
from jaxserve.runtime.cpu_isa import DOT_PATHS
from jaxserve.runtime.expert_matmul import (grouped_gated, grouped_matmul, native_combine, native_gather,
                                            native_grouped, native_route)
from jaxserve.runtime.moe import grouped_experts
from jaxserve.runtime.weight_formats import FORMATS, ExpertStack, stack_experts
from jaxserve.runtime.weight_formats import quantize as quantize_weight

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None, reason="native CPU kernels unavailable")

H, I, E, T, K = 256, 256, 8, 13, 3  # H and I in whole K-quant super-blocks


def stacked(w, name) -> ExpertStack:
    s = stack_experts([quantize_weight(np.asarray(x), name) for x in w])
    return ExpertStack(type(s.w)(*map(jnp.asarray, s.w)))


@pytest.mark.parametrize("name", ["w4a8", "q8_0", "q4_k", "bfloat16"])
@pytest.mark.parametrize("offset", [0, 3])  # 3: ids 0..2 and 11.. belong to other devices
def test_native_rows_bit_identical(name, offset):
    rng = np.random.default_rng(1)
    ws = [stacked(rng.standard_normal((E, a, b)).astype(np.float32) * a ** -0.5, name)
          for a, b in ((H, I), (H, I), (I, H))]
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E + 6, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    num_rows = jnp.asarray([T - 2], jnp.int32)  # two padded tokens
    isa = cpu_kernels.choose_isa()

    def layer(rows):
        return np.asarray(jax.jit(lambda x, ids, w, *s: grouped_experts(
            x, ids, w, *s, num_rows, expert_offset=offset, rows=rows,
            matmul=functools.partial(grouped_matmul, native=True, isa=isa),
            gated=functools.partial(grouped_gated, native=True, isa=isa)))(x, ids, w, *ws))

    def slots(y, order, w):  # the down product's rows in (token, slot) order, and the slots' weights
        return jnp.concatenate([y[jnp.argsort(order)], w.reshape(-1, 1)], axis=1)

    got = layer((native_route, native_gather, native_combine))
    assert got.tobytes() == fma_chain(layer((native_route, lambda x, o: x[o // K], slots))).tobytes()
    np.testing.assert_allclose(got, layer(None), rtol=1e-5, atol=1e-6)


def fma_chain(slots):
    """sum_j w[t, j] y[t, j] as fma(y, w, acc) from 0 in j order (float64 holds y w exactly; the sum
    rounds to float32 once, but for a double rounding of odds ~2^-29)."""
    y, w = slots[:, :-1].reshape(T, K, -1), slots[:, -1].reshape(T, K)
    acc = np.zeros((T, y.shape[2]), np.float32)
    for j in range(K):
        acc = (y[:, j].astype(np.float64) * w[:, j, None] + acc).astype(np.float32)
    return acc


def test_route_is_the_stable_argsort():
    rng = np.random.default_rng(3)
    group = rng.integers(-1, E + 2, 200).astype(np.int32)  # -1 and E..E+1: no expert's
    order, sizes = native_route(jnp.asarray(group), E)
    key = np.where((group >= 0) & (group < E), group, E)
    np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
    np.testing.assert_array_equal(sizes, np.bincount(key, minlength=E + 1)[:E])


def test_combine_matches_einsum_and_refuses_a_bad_order():
    rng = np.random.default_rng(2)
    y = jnp.asarray(rng.standard_normal((T * K, 40)), jnp.float32)  # 40: a tail past the 16-lane vectors
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    order = jnp.asarray(rng.permutation(T * K), jnp.int32)
    got = np.asarray(native_combine(y, order, w))
    slots = np.concatenate([np.asarray(y)[np.argsort(np.asarray(order))], np.asarray(w).reshape(-1, 1)], axis=1)
    assert got.tobytes() == fma_chain(slots).tobytes()
    want = jnp.einsum("tkh,tk->th", y[jnp.argsort(order)].reshape(T, K, -1), w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    x = y[:T]
    np.testing.assert_array_equal(native_gather(x, order), x[order // K])
    none = jnp.zeros((0,), jnp.int32)  # no tokens
    assert native_gather(jnp.zeros((0, 8), jnp.float32), none).shape == (0, 8)
    assert native_combine(jnp.zeros((0, 8), jnp.float32), none, jnp.zeros((0, K), jnp.float32)).shape == (0, 8)
    with pytest.raises(Exception, match="permutation"):
        native_combine(y, order.at[0].set(order[1]), w).block_until_ready()


# Every format; the dot-product formats on each instruction path this machine has (auto: AMX where
# there, else as avx512; portable: the vector code any CPU runs).
PATHS = [(f.name, cap) for f in FORMATS
         for cap in (("auto", "avx512", "portable") if f.name in DOT_PATHS else ("auto",))]


@pytest.mark.parametrize("name,cap", PATHS)
def test_gated_call_reads_rows_in_order(name, cap):
    """native_grouped's `order`: the gated call over the unsorted tokens, reading sorted row r as
    x[order[r] // k], gives the bytes of native_gather then the call over the sorted rows: top 1 and
    top 3, one token and 13, an expert no token chose, a padded token routed to no expert (its rows
    past the groups: zero)."""
    rng = np.random.default_rng(4)
    g, u = (stacked(rng.standard_normal((E, H, I)).astype(np.float32) * H ** -0.5, name) for _ in range(2))
    isa = cpu_kernels.choose_isa(cap)
    gathered = jax.jit(lambda x, o, s, g, u: grouped_gated(native_gather(x, o), g, u, s, native=True, isa=isa))
    ordered = jax.jit(lambda x, o, s, g, u: grouped_gated(x, g, u, s, o, native=True, isa=isa))
    for t, k in ((1, 1), (1, K), (T, 1), (T, K)):
        x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
        ids = np.stack([rng.choice(E - 1, k, replace=False) for _ in range(t)])  # expert E - 1: no rows
        if t > 1:
            ids[-1] = E  # a padded token: no expert's
        order, sizes = native_route(jnp.asarray(ids.reshape(-1), jnp.int32), E)
        want = np.asarray(gathered(x, order, sizes, g, u))
        got = np.asarray(ordered(x, order, sizes, g, u))
        assert got.shape == want.shape == (t * k, I)
        assert got.tobytes() == want.tobytes(), f"{t} tokens, top {k}"
        assert want[:int(sizes.sum())].any() and not want[int(sizes.sum()):].any()


def test_grouped_call_refuses_a_bad_order():
    rng = np.random.default_rng(5)
    g = stacked(rng.standard_normal((E, H, I)).astype(np.float32), "q8_0")
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    order = jnp.asarray(rng.permutation(T * K), jnp.int32)
    sizes = jnp.full((E,), 2, jnp.int32)
    native_grouped(x, g, sizes, up=g, order=order).block_until_ready()
    for bad in (order.at[0].set(order[1]), order.at[0].set(T * K), order[:-1]):  # a repeat, out of range, M % T
        with pytest.raises(Exception, match="permutation"):
            native_grouped(x, g, sizes, up=g, order=bad).block_until_ready()
