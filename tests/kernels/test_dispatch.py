"""Backend selection, and the engine's `pallas` attention backend agreeing with its `xla` one."""

import functools

import jax
import numpy as np
import pytest

import pallas_kernels
from tests.kernels.batch import assert_close, make_batch


def test_auto_backend_on_cpu():
    assert pallas_kernels.resolve_backend("auto") == "reference"
    assert pallas_kernels.resolve_backend("auto", interpret=True) == "tpu"
    with pytest.raises(ValueError, match="unknown attention backend"):
        pallas_kernels.resolve_backend("cuda")


def test_engine_pallas_backend_matches_xla():
    attention = pytest.importorskip("jaxserve.runtime.attention")
    b = make_batch(np.random.default_rng(3), [1, 6, 1], [13, 6, 40], num_q_heads=9,
                   num_kv_heads=3, poison_unused=False)
    kw = dict(sm_scale=0.125)
    xla = jax.jit(functools.partial(attention.get_backend("xla"), **kw))(*b.args)
    pallas = jax.jit(functools.partial(attention.get_backend("pallas"), **kw))(*b.args)
    assert_close(pallas, xla, b.num_real_tokens, rtol=1e-5, atol=1e-5)
