"""Attention sinks (gpt-oss: a learned logit per query head in the softmax denominator) in every
kernel against the jnp reference: the native CPU kernel (tiled, decode-group and generic paths;
float32, bfloat16 and int8/fp8 pages), the Mosaic GPU general and split-KV decode kernels and the
Mosaic TPU kernel (float and quantized pages) in their interpreters. The sink logits span a sink
that takes almost all the mass (8), ones of the scores' size and one that takes none (-30); the
windows and contexts straddle block, tile and chunk boundaries."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxserve.runtime import cpu_kernels
from pallas_kernels import gpu, gpu_decode, kv_quant, reference, tpu
from pallas_kernels.kv_quant import QuantPages
from tests.kernels.batch import assert_close, make_batch

needs_cpu_kernel = pytest.mark.skipif(cpu_kernels.available() is not None, reason="native CPU kernel unavailable")

# (q_lens, kv_lens): decodes at block/chunk edges (16, 17, 64, 65), a prefill chunk over a
# block boundary, a 33-row chunk (CPU: a 32-row work item and a 1-row one, the Q=4 tiles), a
# fresh 1-token sequence.
CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 16, 17, 64, 65]),
    "mixed": ([1, 1, 9, 33, 1], [30, 65, 24, 40, 1]),
}


def sinks_for(num_q_heads: int, seed: int = 0) -> jax.Array:
    """Sink logits from 'takes nearly all the mass' to 'takes none', and some of the scores' size."""
    s = np.random.default_rng(seed).uniform(-2.0, 2.0, num_q_heads).astype(np.float32)
    s[0], s[-1] = 8.0, -30.0
    return jnp.asarray(s)


def oracle(args, **kw):
    q, k, v, *md = args
    if isinstance(k, QuantPages):
        k, v = kv_quant.dequantize(k), kv_quant.dequantize(v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(f32(q), f32(k), f32(v), *md)


def quantized(args, name):
    q, k, v, *md = args
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    return (q, QuantPages(*kv_quant.quantize(k, dtype)), QuantPages(*kv_quant.quantize(v, dtype)), *md)


def test_reference_sink_is_an_extra_logit_without_value():
    """The oracle itself, against numpy on one row: softmax over [scores, sink], sink's value 0."""
    b = make_batch(np.random.default_rng(0), [1], [5], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                   num_pad_seqs=0, pad_tokens=0, poison_unused=False)
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    got = np.asarray(reference.ragged_paged_attention(*b.args, sm_scale=0.3, sinks=sinks))
    q, k, v, _, _, tables, _ = (np.asarray(a) for a in b.args)
    kk = k[tables[0]].reshape(-1, 1, 8)[:5, 0]
    vv = v[tables[0]].reshape(-1, 1, 8)[:5, 0]
    for h in range(2):
        s = np.concatenate([kk @ q[0, h] * 0.3, [float(sinks[h])]])
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(got[0, h], p[:5] @ vv, rtol=1e-5, atol=1e-6)


# block 16 at d64/128/256: the tiled paths (decode groups for G <= 4, TiledItem Q=4 and Q=8);
# block 8 and d40: the generic loop; G=8 decodes: TiledItem (no decode groups past G=4).
@needs_cpu_kernel
@pytest.mark.parametrize("case,heads,head_dim,block_size,window,kv", [
    ("decode", (9, 3), 64, 16, None, "float32"),
    ("decode", (8, 1), 128, 16, 17, "float32"),
    ("mixed", (8, 2), 64, 16, 20, "float32"),
    ("mixed", (4, 2), 256, 16, None, "bfloat16"),
    ("mixed", (6, 2), 40, 8, 9, "float32"),
    ("mixed", (9, 3), 64, 16, 17, "int8"),
    ("decode", (6, 2), 64, 8, None, "fp8_e4m3"),
])
def test_cpu_kernel_sinks(case, heads, head_dim, block_size, window, kv):
    b = make_batch(np.random.default_rng(1), *CASES[case], num_q_heads=heads[0], num_kv_heads=heads[1],
                   head_dim=head_dim, block_size=block_size, pad_tokens=3)
    args = b.args
    if kv == "bfloat16":
        args = (args[0], args[1].astype(jnp.bfloat16), args[2].astype(jnp.bfloat16), *args[3:])
    elif kv != "float32":
        args = quantized(args, kv)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, sinks=sinks_for(heads[0]))
    want = oracle(args, **kw)
    q, k, v, *md = args
    got = jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, **kw))(
        q, *cpu_kernels.to_cpu_layout(k, v), *md)
    assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)
    # the sinks matter here: without them the output differs
    plain = oracle(args, sm_scale=head_dim**-0.5, sliding_window=window)
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 1e-2


@needs_cpu_kernel
@pytest.mark.slow
def test_cpu_kernel_sinks_without_avx512():
    """The same cases on a library built without AVX-512 (``-mno-avx512f``: the attention's
    generic vectors in narrower registers, WidenBytes by conversion), the build a CPU without
    AVX-512 gets. Slow: a second build of the library (cached afterwards under its own key), at -O0
    (~16 s of CPU against ~45 s at -O3; the kernels' results do not depend on it, and an intrinsic
    the target lacks fails at any level: always_inline is inlined at -O0 too)."""
    env = {**os.environ, "JAXSERVE_CXXFLAGS": "-mno-avx512f -O0"}
    check = ("from jaxserve.runtime import cpu_kernels as c; assert c.available() is None, c.available(); "
             "isa = c._state['lib'].JaxserveDotIsa(); assert isa & 3 == 0, isa")
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_cpu_kernel_sinks"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_cpu_kernel
def test_cpu_kernel_rejects_sinks_of_the_wrong_shape():
    b = make_batch(np.random.default_rng(1), [1], [5], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    q, k, v, *md = b.args
    with pytest.raises(ValueError, match=r"sinks must be f32\[4\]"):
        cpu_kernels.cpu_ragged_paged_attention(q, *cpu_kernels.to_cpu_layout(k, v), *md, sm_scale=0.1,
                                               sinks=jnp.zeros((2,), jnp.float32))


# Pallas kernels in their interpreters (slow: tiny sizes). GPU: bf16 q/KV and WGMMA operands, so
# the reference runs on the same bf16-rounded inputs in float32 and bf16 tolerances apply.
@pytest.mark.parametrize("case,heads,block_size,ppc,window,kv", [
    ("mixed", (8, 2, 64), 16, 4, 20, "bfloat16"),  # chunk 64: windows and contexts across chunks
    ("mixed", (8, 1, 64), 8, 8, None, "bfloat16"),  # G = 8 (gpt-oss), 8 tokens per 64-row tile
    ("mixed", (6, 2, 64), 16, 4, 17, "int8"),
])
def test_gpu_general_kernel_sinks_interpreted(case, heads, block_size, ppc, window, kv):
    hq, hkv, d = heads
    b = make_batch(np.random.default_rng(2), *CASES[case], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   block_size=block_size, pad_tokens=3, dtype=jnp.bfloat16)
    args = b.args if kv == "bfloat16" else quantized(b.args, kv)
    kw = dict(sm_scale=d**-0.5, sliding_window=window, sinks=sinks_for(hq, 1))
    got = jax.jit(functools.partial(gpu.ragged_paged_attention, pages_per_chunk=ppc, interpret=True, **kw))(*args)
    assert_close(got.astype(jnp.float32), oracle(args, **kw), b.num_real_tokens, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("heads,window,splits", [((8, 2, 64), None, 3), ((8, 1, 64), 17, 2)])
def test_gpu_decode_kernel_sinks_interpreted(heads, window, splits):
    """Split-KV decode: the sinks enter in the XLA combine of the splits (empty splits included:
    the 1-token context leaves all but one empty)."""
    hq, hkv, d = heads
    b = make_batch(np.random.default_rng(3), *CASES["decode"], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   block_size=16, num_pad_seqs=2, pad_tokens=2, dtype=jnp.bfloat16)
    kw = dict(sm_scale=d**-0.5, sliding_window=window, sinks=sinks_for(hq, 2))
    kernel = functools.partial(gpu_decode.decode_attention, num_splits=splits, pages_per_chunk=4, interpret=True)
    got = jax.jit(functools.partial(kernel, **kw))(*b.args)
    assert_close(got.astype(jnp.float32), oracle(b.args, **kw), b.num_real_tokens, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case,heads,block_size,window,kv,extra", [
    ("mixed", (8, 2, 64), 8, 9, "float32", {}),
    ("decode", (8, 1, 64), 8, None, "float32", {"decode_only": True}),
    ("mixed", (6, 2, 64), 8, None, "float32", {"table_smem_bytes": 512}),  # tables split over calls
    ("mixed", (8, 2, 64), 32, 20, "int8", {}),  # 8-bit pages: blocks of 32 rows
])
def test_tpu_kernel_sinks_interpreted(case, heads, block_size, window, kv, extra):
    hq, hkv, d = heads
    b = make_batch(np.random.default_rng(4), *CASES[case], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   block_size=block_size, pad_tokens=0 if extra.get("decode_only") else 3)
    args = b.args if kv == "float32" else quantized(b.args, kv)
    kw = dict(sm_scale=d**-0.5, sliding_window=window, sinks=sinks_for(hq, 3))
    sizes = {"pages_per_chunk": 2} if extra.get("decode_only") else {"block_q": 4, "pages_per_chunk": 2}
    sizes.update({k: v for k, v in extra.items() if k != "decode_only"})
    fn = functools.partial(pallas_kernels.ragged_paged_attention, backend="tpu", interpret=True,
                           decode_only=extra.get("decode_only", False), **sizes, **kw)
    got = jax.jit(fn)(*args)
    assert_close(got, oracle(args, **kw), b.num_real_tokens, rtol=2e-5, atol=2e-5)


def test_pallas_kernels_reject_sinks_of_the_wrong_shape():
    b = make_batch(np.random.default_rng(5), [1], [5], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    bad = jnp.zeros((2,), jnp.float32)
    with pytest.raises(ValueError, match=r"sinks must be f32\[4\]"):
        tpu.ragged_paged_attention(*b.args, sm_scale=0.1, sinks=bad, interpret=True)
    bf = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in b.args)
    with pytest.raises(ValueError, match=r"sinks must be f32\[4\]"):
        gpu.ragged_paged_attention(*bf, sm_scale=0.1, sinks=bad, interpret=True)
