"""Backend selection, and the engine's `pallas` attention backend agreeing with its `xla` one."""

import functools

import jax
import jax.numpy as jnp
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
    kw = {"sm_scale": 0.125}
    xla = jax.jit(functools.partial(attention.get_backend("xla"), **kw))(*b.args)
    pallas = jax.jit(functools.partial(attention.get_backend("pallas"), **kw))(*b.args)
    assert_close(pallas, xla, b.num_real_tokens, rtol=1e-5, atol=1e-5)


GATE = {"dtype": jnp.bfloat16, "head_dim": 128, "group": 4, "block_size": 16}


def test_gate_gpu_admits_only_hopper():
    """Blackwell has no wgmma: sm_100 and sm_120 get the xla fallback (what the compile tier proves)."""
    assert pallas_kernels.supported("gpu", compute_capability="9.0", **GATE) is None
    for cc in ("8.0", "8.9", None, (10, 0), "12.0"):
        reason = pallas_kernels.supported("gpu", compute_capability=cc, **GATE)
        assert "sm_90" in reason


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gate_accepts_every_served_shape(group, head_dim, block_size):
    for dtype in (jnp.bfloat16, jnp.float16):
        shape = {"dtype": dtype, "head_dim": head_dim, "group": group, "block_size": block_size}
        assert pallas_kernels.supported("gpu", compute_capability="9.0", **shape) is None
        assert pallas_kernels.supported("tpu", **shape) is None


def test_gate_names_what_is_unsupported():
    gpu = functools.partial(pallas_kernels.supported, "gpu", compute_capability="9.0")
    assert "bfloat16" in gpu(**{**GATE, "dtype": jnp.float32})
    assert "head_dim" in gpu(**{**GATE, "head_dim": 72})
    assert "GQA" in gpu(**{**GATE, "group": 65})
    assert "block size" in gpu(**{**GATE, "block_size": 12})
    assert "head_dim" in pallas_kernels.supported("tpu", **{**GATE, "head_dim": 48})
    assert "int8" in pallas_kernels.supported("tpu", **{**GATE, "dtype": jnp.int8})
    assert "xla" in pallas_kernels.supported("rocm", **GATE)


def test_gpu_kernel_raises_the_gate_reason():
    b = make_batch(np.random.default_rng(12), [1], [1], head_dim=72, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        pallas_kernels.ragged_paged_attention(*b.args, sm_scale=0.1, backend="gpu",
                                              interpret=True)


def test_pallas_on_tpu_gets_the_fused_layout():
    """tpu + pallas (and pallas on CPU: the TPU kernel interpreted) -> tpu-fused; gpu -> paged."""
    from jaxserve.runtime.backend import KV_LAYOUTS, KernelShape, resolve_backend

    shape = KernelShape(head_dim=64, group=3, block_size=16)
    tpu = resolve_backend(None, "bfloat16", "bfloat16", shape=shape, target="tpu")
    gpu = resolve_backend(None, "bfloat16", "bfloat16", shape=shape, target="cuda", compute_capability="9.0")
    cpu = resolve_backend("pallas", "float32", "float32")
    assert (tpu.attention, tpu.kv_layout) == ("pallas", "tpu-fused")
    assert (gpu.attention, gpu.kv_layout) == ("pallas", "paged")
    assert cpu.kv_layout == "tpu-fused" and "tpu-fused" in KV_LAYOUTS
    # 16-bit KV needs pages of 16 tokens (the sublane packing): else the portable path
    small = resolve_backend(None, "bfloat16", "bfloat16", shape=KernelShape(64, 3, 8), target="tpu")
    assert (small.attention, small.kv_layout) == ("xla", "paged")
