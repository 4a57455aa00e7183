"""The native CPU backend (`--attention-backend cpu`, jaxserve/runtime/csrc/): paged
attention against the pure-jnp oracle on ragged batches with NaN-poisoned unused pages, the KV
write against the XLA scatter, the packed matmul of the linear layers against float64 (and its
rows against themselves in other batches), the engine against the `xla` backend, and the fallback
when the kernels cannot be built."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import UserError
from jaxserve.runtime import cpu_kernels
from jaxserve.runtime.backend import PackedWeight, resolve_backend
from pallas_kernels import reference
from tests.kernels.batch import assert_close, make_batch

WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")

CASES = {
    "decode": ([1, 1, 1, 1], [1, 9, 16, 17]),
    "prefill": ([5, 16, 17], [5, 16, 17]),
    "chunked": ([8, 3, 1, 12], [40, 3, 70, 12]),
    # more than one 32-row work item per sequence, decodes and prefill chunks in one batch
    "mixed-long": ([1] * 6 + [70, 40], [33, 64, 65, 2, 100, 7, 90, 41]),
    # many decode groups (16 per pool thread), contexts 1..80, and a prefill chunk
    "many-decodes": ([1] * (16 * (os.cpu_count() or 1) + 5) + [20],
                     [1 + (7 * i) % 80 for i in range(16 * (os.cpu_count() or 1) + 5)] + [50]),
}


@needs_kernel
@pytest.mark.parametrize(
    "case,heads,head_dim,block_size,window,cap",
    [
        ("decode", (9, 3), 64, 16, None, None),  # SmolLM2's shape: the tiled fast path
        ("decode", (4, 4), 128, 32, 6, None),
        ("prefill", (8, 2), 64, 16, None, None),
        ("prefill", (4, 4), 64, 16, None, 15.0),
        ("chunked", (9, 3), 64, 16, 6, None),
        ("chunked", (8, 2), 128, 16, None, None),
        ("mixed-long", (9, 3), 64, 16, None, None),
        ("many-decodes", (9, 3), 64, 16, None, None),
        ("many-decodes", (8, 2), 128, 16, 30, None),
        ("decode", (4, 4), 256, 16, None, None),
        ("mixed-long", (8, 2), 64, 32, 20, 15.0),
        ("mixed-long", (9, 3), 64, 8, None, None),  # block_size 8: the generic path
        ("chunked", (6, 2), 40, 16, 6, 15.0),  # head_dim 40: the generic path
    ],
)
def test_cpu_kernel_matches_reference(case, heads, head_dim, block_size, window, cap):
    q_lens, kv_lens = CASES[case]
    b = make_batch(np.random.default_rng(len(case)), q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                   head_dim=head_dim, block_size=block_size, pad_tokens=5)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*b.args)
    q, k, v, *md = b.args
    got = jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, **kw))(
        q, *cpu_kernels.to_cpu_layout(k, v), *md)
    assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)


# attribute isa 1 (bfloat16 pages' scores and sums as AVX-512 BF16 dot products) where built and on the CPU
DOT_BF16 = WHY is None and cpu_kernels.attention_isa(cpu_kernels.choose_isa("avx512")) == 1
ISAS = [0, pytest.param(1, marks=pytest.mark.skipif(not DOT_BF16, reason="no AVX-512 BF16 here"))]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case,block_size,head_dim,heads", [
    ("mixed-long", 16, 64, (9, 3)), ("chunked", 32, 64, (9, 3)), ("mixed-long", 8, 64, (9, 3)),
    ("mixed-long", 16, 128, (9, 3)), ("chunked", 16, 256, (9, 3)),
    ("many-decodes", 16, 64, (8, 1)),  # 8 query heads a kv head: decode rows as items, not groups
])
def test_cpu_kernel_bfloat16_pages(case, block_size, head_dim, heads, isa):
    """bfloat16 KV storage (--kv-cache-dtype bfloat16). isa 0: widened exactly on load (prefill tiles
    once per tile, for every group of query vectors), float32 math. isa 1: q and the probabilities
    rounded to bfloat16 too, so within bfloat16's rounding of the float32 result (2^-7 of the
    output's scale here; isa 0 within 2e-5), finite although unused pages hold NaN."""
    q_lens, kv_lens = CASES[case]
    b = make_batch(np.random.default_rng(7), q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                   block_size=block_size, head_dim=head_dim, pad_tokens=5)
    q, k, v, *md = b.args
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    scale = head_dim**-0.5
    want = reference.ragged_paged_attention(q, k, v, *md, sm_scale=scale)  # the oracle widens the pages too
    run = lambda isa: jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, sm_scale=scale, isa=isa))(  # noqa: E731
        q, *cpu_kernels.to_cpu_layout(k, v), *md)
    got = run(isa)
    if isa == 0:
        assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)
        return
    n = b.num_real_tokens
    bound = 2**-7 * float(jnp.abs(want[:n]).max())
    assert_close(got, want, n, rtol=0, atol=bound)
    # the dot products ran (their rounding shows) where the tiled fast path does; block size 8 takes
    # the generic loops, which have no isa 1
    differs = float(jnp.abs(got[:n] - run(0)[:n]).max()) > 0
    assert differs == (block_size % 16 == 0)


@needs_kernel
@pytest.mark.skipif(not DOT_BF16, reason="no AVX-512 BF16 here")
def test_cpu_kernel_isa_leaves_float32_pages_alone():
    """isa 1 is for bfloat16 pages: float32 pages give isa 0's bits."""
    q_lens, kv_lens = CASES["mixed-long"]
    b = make_batch(np.random.default_rng(3), q_lens, kv_lens, num_q_heads=9, num_kv_heads=3, pad_tokens=5)
    q, k, v, *md = b.args
    run = lambda isa: np.asarray(jax.jit(functools.partial(  # noqa: E731
        cpu_kernels.cpu_ragged_paged_attention, sm_scale=0.125, isa=isa))(q, *cpu_kernels.to_cpu_layout(k, v), *md))
    np.testing.assert_array_equal(run(1), run(0))


@needs_kernel
@pytest.mark.parametrize("block_size,head_dim,dtype", [(16, 64, "float32"), (8, 40, "float32"),
                                                     (16, 64, "bfloat16")])
def test_cpu_write_kv_matches_scatter_in_place(block_size, head_dim, dtype):
    rng = np.random.default_rng(0)
    k_pages = jnp.asarray(rng.standard_normal((6, block_size, 3, head_dim)), dtype)
    v_pages = k_pages + 1
    k = rng.standard_normal((10, 3, head_dim)).astype(np.float32)
    v = rng.standard_normal((10, 3, head_dim)).astype(np.float32)
    slots = jnp.asarray([17, 18, 19, 40, 41, 0, 0, 47, 33, 34], jnp.int32)  # padding rows -> null slot 0
    want = cpu_kernels.to_cpu_layout(*jax.jit(reference.write_kv)(k_pages, v_pages, k, v, slots))
    before = cpu_kernels.to_cpu_layout(k_pages, v_pages)
    got = jax.jit(cpu_kernels.cpu_write_kv, donate_argnums=(0, 1))(*before, k, v, slots)
    for g, w in zip(got, want):  # written slots changed, every other slot kept (in place)
        assert g.dtype == w.dtype == jnp.dtype(dtype)
        # bit-identical: bfloat16 rounds to nearest even, like XLA's convert
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_engine_cpu_backend_matches_xla_greedy(tiny_model, kv_dtype):
    path = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n" * 3, "JAX", "x " * 40]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=24,
              kv_cache_dtype=kv_dtype)
    want = [o.outputs[0].token_ids
            for o in LLM(path, attention_backend="xla", **kw).generate(prompts, p, use_tqdm=False)]
    llm = LLM(path, attention_backend="cpu", **kw)
    assert llm.engine.runner.kv_caches[0][0].dtype == jnp.dtype(kv_dtype)
    # float32 compute keeps float32 attention products on bfloat16 pages too (isa 0)
    backend = llm.engine.runner.backend
    assert backend.attention_isa == 0 and "dot products" not in backend.describe()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    assert got == want


def test_backend_is_resolved_once_on_cpu():
    native = WHY is None
    assert resolve_backend(None, "bfloat16", "bfloat16").attention == "xla"  # native kernels compute in float32
    assert resolve_backend(None, "float32", "float16").attention == "xla"
    b = resolve_backend(None, "float32", "bfloat16")
    assert b.attention == ("cpu" if native else "xla") and b.native_linear == native
    assert b.kv_layout == ("cpu-tiled" if native else "paged")
    assert "platform=cpu" in b.describe()
    assert not resolve_backend(None, "float32", "float32", tensor_parallel_size=2).native_linear
    with pytest.raises(UserError, match="float32"):
        resolve_backend("cpu", "bfloat16", "bfloat16")
    with pytest.raises(UserError, match="Unknown attention backend 'cuda'"):
        resolve_backend("cuda", "float32", "float32")


def test_cpu_backend_falls_back_or_fails_clearly(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {"error": "RuntimeError: no C++ compiler found"})
    fallback = resolve_backend(None, "float32", "float32")
    assert fallback.attention == "xla" and not fallback.native_linear and "no C++ compiler" in fallback.reason
    with pytest.raises(UserError, match="no C\\+\\+ compiler found.*--attention-backend xla"):
        resolve_backend("cpu", "float32", "float32")


@needs_kernel
@pytest.mark.parametrize("k,n", [(64, 64), (576, 192), (40, 128)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 48, 49, 113])
def test_cpu_matmul_matches_float64(m, k, n):
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    wp = cpu_kernels.pack_kernel(jnp.asarray(w))
    assert wp.shape == (n // 64, k, 64)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_kernel(wp)), w)
    got = np.asarray(jax.jit(cpu_kernels.cpu_matmul)(jnp.asarray(x), wp))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)


def _packed_problem(seed: int, m: int, k: int, n: int):
    """Random float32 x[m, k] and a packed random W[k, n]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    return x, cpu_kernels.pack_kernel(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))


@needs_kernel
def test_cpu_matmul_row_does_not_depend_on_the_batch():
    """The same row gives bit-identical results alone, in a batch of 7, or of 100, at any offset."""
    x, wp = _packed_problem(0, 100, 576, 192)
    mm = jax.jit(cpu_kernels.cpu_matmul)
    full = np.asarray(mm(x, wp))
    for lo, hi in [(0, 1), (3, 10), (50, 100), (97, 98)]:
        np.testing.assert_array_equal(np.asarray(mm(x[lo:hi], wp)), full[lo:hi])


def test_runner_packs_linear_kernels_only_for_the_cpu_backend(tiny_model):
    path = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    kw = dict(precompile=False, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_blocks=16)
    attn = lambda llm: llm.engine.runner.params["layers_0"]["self_attn"]
    ref = LLM(path, attention_backend="xla", **kw)
    assert attn(ref)["q_proj"]["kernel"].shape == (64, 64) and not ref.engine.runner.backend.native_linear
    if WHY is not None:
        return
    llm = LLM(path, attention_backend="cpu", **kw)
    assert llm.engine.runner.backend.native_linear
    assert isinstance(attn(llm)["q_proj"]["kernel"], PackedWeight)
    assert attn(llm)["q_proj"]["kernel"].panels.shape == (1, 64, 64)  # N = 64: one panel
    assert attn(llm)["k_proj"]["kernel"].shape == (64, 32)  # N = 32: not a multiple of 64, XLA's dot
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_kernel(attn(llm)["q_proj"]["kernel"].panels)),
                                  np.asarray(attn(ref)["q_proj"]["kernel"]))


@needs_kernel
def test_packed_tied_embedding_gathers_rows_and_attends():
    """A tied table held once as LM-head panels: token rows and logits as from the plain table."""
    from jaxserve.model.llama import Embed

    rng = np.random.default_rng(0)
    table = rng.standard_normal((192, 40)).astype(np.float32)
    ids = jnp.asarray([0, 5, 63, 64, 191, 5], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
    ops = resolve_backend("cpu", "float32", "float32").ops()
    plain = packed = Embed(192, 40, jnp.float32, ops)  # the op dispatches on the weight's format
    pv = {"params": {"embedding": PackedWeight(cpu_kernels.pack_kernel(jnp.asarray(table).T))}}
    np.testing.assert_array_equal(np.asarray(packed.apply(pv, ids)), table[np.asarray(ids)])
    want = plain.apply({"params": {"embedding": jnp.asarray(table)}}, x, method="attend")
    np.testing.assert_allclose(np.asarray(packed.apply(pv, x, method="attend")), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (5, 16), (64, 49152), (7, 1000)])
def test_argmax_rows_matches_argmax_first_among_ties(rows, vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, (rows, vocab)).astype(np.float32)  # few distinct values: many ties
    x[0, -1] = 10.0  # a maximum in the scalar tail
    got = np.asarray(jax.jit(cpu_kernels.argmax_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@needs_kernel
def test_cpu_matmul_computes_only_the_real_rows():
    x, wp = _packed_problem(1, 24, 64, 128)
    mm = jax.jit(cpu_kernels.cpu_matmul)
    full = np.asarray(mm(x, wp))
    for rows in (0, 1, 7, 24, 99):
        got = np.asarray(mm(x, wp, rows))
        n = min(rows, 24)
        np.testing.assert_array_equal(got[:n], full[:n])
        assert not got[n:].any()


@needs_kernel
@pytest.mark.parametrize("m,rows", [(1, 1), (7, 7), (64, 58), (100, 100)])
def test_cpu_matmul_gated_matches_silu_times_up(m, rows):
    """silu(x @ W_gate) * (x @ W_up) with the activation applied per tile, against XLA's ops on the
    same native matmuls; rows stay independent of the batch; padding rows zero."""
    rng = np.random.default_rng(m + 1)
    x = jnp.asarray(rng.standard_normal((m, 576)), jnp.float32)
    # large enough pre-activations to reach both of SiLU's tails
    wg, wu = (cpu_kernels.pack_kernel(jnp.asarray(rng.standard_normal((576, 1536)) * 0.3, jnp.float32))
              for _ in range(2))
    gated = jax.jit(cpu_kernels.cpu_matmul_gated)
    got = np.asarray(gated(x, wg, wu, rows))
    mm = jax.jit(cpu_kernels.cpu_matmul)
    want = np.asarray(jax.nn.silu(mm(x, wg, rows)) * mm(x, wu, rows))
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=2e-6, atol=2e-6)
    assert not got[rows:].any()
    if rows > 3:
        np.testing.assert_array_equal(np.asarray(gated(x[2:4], wg, wu)), got[2:4])
