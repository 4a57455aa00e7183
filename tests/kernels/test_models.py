"""Both Pallas kernels (in their interpreters) at the head shapes of the model families we serve
(each family's GQA ratio and head_dim, at most 2 KV heads: batch.interpreted_heads), against the
jnp reference, for decode, prefill, chunked-prefill and mixed batches.

Pages a batch does not reference (the null block too) hold NaN, so a read outside a sequence's
own context fails. Each model runs the mixed batch; a few run each single kind. Contexts are short
but cross a GPU chunk (128 tokens) and page boundaries.
GPU: bf16 (WGMMA operands), compared on the same rounded inputs in f32; TPU: f32, exact.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu, reference, tpu
from tests.kernels.batch import MODELS, assert_close, interpreted_heads, make_batch

# (q_lens, kv_lens); kv_lens include the new tokens; a 0-length real sequence in chunked.
BATCHES = {
    "decode": ([1, 1, 1], [1, 16, 150]),
    "prefill": ([16, 17, 3], [16, 17, 3]),
    "chunked": ([5, 0, 9], [140, 9, 30]),
    "mixed": ([1, 12, 1, 4], [33, 12, 131, 20]),
}
KW = {"sm_scale": 0.125}
# Every model runs the mixed batch (decode rows, whole prefills and chunks in one step); each
# single-kind batch runs on a few models chosen to span GQA ratios 1-16 and head_dim 64/128,
# which keeps the interpreters' cost near a minute.
SINGLE_KIND = {
    "decode": ("smollm2-135m", "llama3.1-70b/qwen2.5-72b/qwen3-32b", "gqa16"),
    "prefill": ("qwen2.5-0.5b", "qwen3-0.6b"),
    "chunked": ("llama3.2-3b", "smollm2-1.7b"),
}
PAIRS = [(m, "mixed") for m in MODELS] + [(m, c) for c, ms in SINGLE_KIND.items() for m in ms]


def _run(kernel_fn, batch, to_f32, **kw):
    out = jax.jit(functools.partial(kernel_fn, **KW, **kw))(*batch.args)
    args = batch.args
    if to_f32:
        args = tuple(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **KW, **kw))(*args)
    return out, ref


def _batch(model, case, dtype, seed: str):
    hq, hkv, d = interpreted_heads(model)
    rng = np.random.default_rng(zlib.crc32(f"{model}-{case}-{seed}".encode()))
    return make_batch(rng, *BATCHES[case], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      block_size=16, dtype=dtype)


@pytest.mark.parametrize("model,case", PAIRS)
def test_gpu_kernel(model, case):
    b = _batch(model, case, jnp.bfloat16, "gpu")
    out, ref = _run(functools.partial(gpu.ragged_paged_attention, interpret=True), b, True)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, b.num_real_tokens, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model,case", PAIRS)
def test_tpu_kernel(model, case):
    b = _batch(model, case, jnp.float32, "tpu")
    kernel = functools.partial(tpu.ragged_paged_attention, block_q=8, pages_per_chunk=4,
                               interpret=True)
    out, ref = _run(kernel, b, False)
    assert_close(out, ref, b.num_real_tokens, rtol=1e-5, atol=1e-5)
