"""The Mosaic GPU operations the attention kernels (``gpu``, ``gpu_decode``) are written with:
WGMMA for QK^T and PV, layout casts, the widening of quantized chunks and their scales, each with
the substitute Pallas' Mosaic GPU interpreter needs (``interpret=True``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.gpu_plan import ROWS


class Ops:
    """The Mosaic GPU pieces both kernels use, with the interpreter's substitutes."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def layout_cast(self, x, layout):
        # The Mosaic GPU interpreter has no rule for layout_cast; layouts only matter when lowering.
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        return self.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)

    def mma_qk(self, q_ref, k_ref):  # [ROWS, D] x [chunk, D]^T -> f32[ROWS, chunk]
        if self.interpret:  # the interpreter's wgmma takes neither transposed refs nor register lhs
            return lax.dot_general(
                q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, q_ref, plgpu.transpose_ref(k_ref, (1, 0)))
            return acc_ref[...]

        return pl.run_scoped(scope, plgpu.ACC((ROWS, k_ref.shape[0]), jnp.float32))

    def mma_pv(self, p, v_ref):  # [ROWS, chunk] (registers) x [chunk, D] -> f32[ROWS, D]
        if self.interpret:
            return jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, p, v_ref)
            return acc_ref[...]

        # A fresh accumulator rather than ACC.init(acc) + run_state: keeps one code shape.
        return pl.run_scoped(scope, plgpu.ACC((ROWS, v_ref.shape[1]), jnp.float32))

    def widen(self, src, dst):
        """A quantized SMEM chunk -> its compute-dtype copy ``dst`` (exact), for the MMA."""
        x = src[...]
        if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating) and dst.dtype != x.dtype:
            x = x.astype(jnp.float16)  # exact; sm_90 converts fp8 to f16 only (f16 -> bf16 is exact too)
        dst[...] = x.astype(dst.dtype)
        plgpu.commit_smem()  # the MMA reads dst through the async proxy
        return dst

    def scales(self, slot_ref, kv: int, block_size: int):
        """A chunk's K (``kv`` 0) or V (1) scales from its slot [pages, 2, width]: f32[chunk] in
        the column layout of the scores (a [pages, block_size] load, pages laid end to end)."""
        pages = slot_ref.shape[0]
        # one page: a 1-D load (Mosaic folds no unit dim of a non-contiguous [1, bs] view)
        ref = slot_ref.at[0 if pages == 1 else slice(None), kv, pl.ds(0, block_size)]
        if self.interpret:
            x = ref[...]
        else:
            x = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))
        return x.reshape(pages * block_size)

    def init_carry(self, head_dim):
        acc = self.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        row = plgpu.Layout.WGMMA.reduce(1)
        m_i = self.layout_cast(jnp.full((ROWS,), common.MASK_VALUE, jnp.float32), row)
        l_i = self.layout_cast(jnp.zeros((ROWS,), jnp.float32), row)
        return acc, m_i, l_i
