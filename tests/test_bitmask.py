"""The packed token mask applied in jax equals the numpy reference, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    bitmask_width,
    full_bitmask,
)


@pytest.mark.parametrize("rows, vocab", [(1, 32), (3, 33), (8, 384), (4, 49152), (2, 100)])
def test_matches_numpy_reference(rows, vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, (rows, bitmask_width(vocab)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = -1  # an unconstrained row
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    want = apply_token_bitmask_ref(logits, mask)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])
    # bit j of word i is token 32 i + j
    for r in range(rows):
        for tok in rng.integers(0, vocab, 20):
            bit = (int(mask[r, tok // 32]) >> (tok % 32)) & 1
            assert np.isfinite(got[r, tok]) == bool(bit)


def test_full_bitmask_keeps_everything_and_single_token_rows():
    vocab = 70
    logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
    mask = full_bitmask(2, vocab)
    mask[1] = 0
    mask[1, 65 // 32] = 1 << (65 % 32)  # only token 65
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got[0], logits[0])
    assert np.flatnonzero(np.isfinite(got[1])).tolist() == [65]
    assert int(np.argmax(got[1])) == 65


def test_matcher_fill_feeds_the_device_mask():
    """A row filled by the grammar matcher, applied on device, leaves exactly the allowed ids."""
    from jaxserve.structured import StructuredOutputs
    from jaxserve.structured.compiler import GrammarCompiler
    from tests.tiny_models import build_tokenizer

    hf = build_tokenizer()
    vocab = len(hf) + 64
    m = GrammarCompiler(hf, vocab, [hf.eos_token_id]).compile(
        StructuredOutputs(choice=["yes", "no"])).matcher()
    mask = full_bitmask(2, vocab)
    m.fill_bitmask(mask[1])
    logits = np.zeros((2, vocab), np.float32)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    allowed = {hf.decode([i]) for i in np.flatnonzero(np.isfinite(got[1]))}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    assert np.isfinite(got[0]).all()
