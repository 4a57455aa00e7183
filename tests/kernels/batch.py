"""Random ragged paged-attention batches in the engine's layout (shared by the kernel tests)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# (Hq, Hkv, head_dim) of each family; several share a shape and are tested once.
MODELS = {
    "llama3.1-8b/mistral-7b/qwen3-8b": (32, 8, 128),  # G=4
    "llama3.1-70b/qwen2.5-72b/qwen3-32b": (64, 8, 128),  # G=8
    "llama3.2-1b": (32, 8, 64),  # G=4
    "llama3.2-3b": (24, 8, 128),  # G=3
    "qwen2.5-0.5b": (14, 2, 64),  # G=7
    "qwen2.5-1.5b": (12, 2, 128),  # G=6
    "qwen2.5-3b": (16, 2, 128),  # G=8
    "qwen2.5-7b": (28, 4, 128),  # G=7
    "qwen2.5-14b/32b": (40, 8, 128),  # G=5
    "qwen3-0.6b": (16, 8, 128),  # G=2
    "qwen3-30b-a3b": (32, 4, 128),  # G=8
    "smollm2-135m": (9, 3, 64),  # G=3 (the default model)
    "smollm2-360m": (15, 5, 64),  # G=3
    "smollm2-1.7b": (32, 32, 64),  # G=1
    "gqa16": (16, 1, 128),
}



def interpreted_heads(model: str, max_kv_heads: int = 2) -> tuple[int, int, int]:
    """A family's (Hq, Hkv, head_dim) for an interpreter test: its GQA ratio and head_dim with at
    most `max_kv_heads` KV heads. Each kernel program (or unrolled head step) runs the same code
    for one KV head's query group, and the interpreters run them one by one, so a family's 8 KV
    heads cost 4x its 2 for no code path more. The families' full head counts are compiled by the
    compile tier (tools/compile_tier.py) and lowered in tests/kernels/test_lowering.py."""
    hq, hkv, d = MODELS[model]
    kv = min(hkv, max_kv_heads)
    return hq // hkv * kv, kv, d

@dataclasses.dataclass
class Batch:
    args: tuple  # (q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, num_seqs)
    num_real_tokens: int
    used_blocks: np.ndarray  # block ids referenced by some real sequence


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 8,
    num_pad_seqs: int = 1,
    pad_tokens: int = 3,
    dtype=jnp.float32,
    poison_unused: bool = True,
) -> Batch:
    """kv_lens include the new tokens. Unreferenced blocks (and the null block) hold NaN when
    ``poison_unused``, so any read outside a sequence's own context poisons the output."""
    assert all(0 <= q <= kv for q, kv in zip(q_lens, kv_lens))
    num_seqs = len(q_lens)
    total_seqs = num_seqs + num_pad_seqs
    max_blocks = max((-(-kv // block_size) for kv in kv_lens), default=0) + 1
    need = sum(-(-kv // block_size) for kv in kv_lens)
    num_blocks = need + 4
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((total_seqs, max_blocks), np.int32)
    taken = 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // block_size)
        tables[s, :n] = perm[taken : taken + n]
        taken += n
    qsl = np.zeros(total_seqs + 1, np.int32)
    qsl[1 : num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1 :] = qsl[num_seqs]
    seq_lens = np.zeros(total_seqs, np.int32)
    seq_lens[:num_seqs] = kv_lens
    num_tokens = int(qsl[-1]) + pad_tokens

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    used = perm[:taken]
    if poison_unused:
        unused = np.setdiff1d(np.arange(num_blocks), used)
        k[unused] = np.nan
        v[unused] = np.nan
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(seq_lens),
        jnp.asarray(qsl),
        jnp.asarray(tables),
        jnp.asarray([num_seqs], jnp.int32),
    )
    return Batch(args, int(qsl[-1]), used)


def assert_close(out, ref, num_real_tokens: int, *, rtol: float, atol: float) -> None:
    """Finite everywhere (NaN never passes), zero padding rows, close to the reference."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} NaN / non-finite outputs"
    assert np.isfinite(ref).all(), "reference is not finite"
    np.testing.assert_array_equal(out[num_real_tokens:], 0.0)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
