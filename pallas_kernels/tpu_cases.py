"""Every TPU kernel at the shapes the project serves, as compile cases with their budgets.

``cases()`` yields ``Case``s: the function (``fn``), its ``ShapeDtypeStruct`` arguments (``args``)
and the kernel's own VMEM estimate, VMEM limit and SMEM bytes, for the attention kernel (mixed and
decode buckets) and the fused KV write, per model family (per-device heads under tensor
parallelism), KV dtype (bf16, int8, fp8) and context length. ``run(case, topology)`` compiles one
with ``compile_check.tpu_compile_check`` and returns the table row; ``bench/tpu_kernel_compile.py``
prints the table, and a CI compile tier can iterate ``cases()`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from pallas_kernels import compile_check, kv_quant, kv_write, tpu, tpu_budget
from pallas_kernels.kv_quant import QuantPages

S = jax.ShapeDtypeStruct
# family -> (q heads, kv heads, head_dim); Qwen3-8B has Llama-3.1-8B's attention shapes
MODELS = {
    "llama-3.1-8b/qwen3-8b": (32, 8, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "smollm2-135m": (9, 3, 64),
    "gemma3-12b (hd256)": (16, 8, 256),
}
BUCKETS = {"T512 S64 mixed": (512, 64, False), "T64 S64 decode": (64, 64, True),
           "T1 S1 decode": (1, 1, True)}
KV_DTYPES = {"bf16": ("bfloat16", 16), "int8": ("int8", 32), "fp8": ("fp8_e4m3", 32)}
NUM_BLOCKS = 4096


@dataclass
class Case:
    kernel: str
    model: str
    bucket: str
    kv: str
    tp: int
    max_model_len: int
    fn: Callable = field(repr=False)
    args: tuple = field(repr=False)
    vmem_estimate: int = 0
    vmem_limit: int = 0
    smem_bytes: int = 0


def per_device(num_q_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int, int]:
    """(tp, q heads, kv heads) on one device: tp shrinks to the largest divisor of the q heads (as
    a user must pick), kv heads repeat when tp exceeds them."""
    while num_q_heads % tp:
        tp -= 1
    return tp, num_q_heads // tp, max(num_kv_heads // tp, 1)


def _pages(kv: str, hkv: int, d: int):
    name, bs = KV_DTYPES[kv]
    if kv_quant.is_quantized(name):
        dtype = kv_quant.KV_QUANT_DTYPES[name]
        return QuantPages(S(tpu.fused_shape(NUM_BLOCKS, bs, hkv, d, dtype), dtype),
                          S(tpu.fused_scale_shape(NUM_BLOCKS, bs, hkv), jnp.float32)), bs
    return S(tpu.fused_shape(NUM_BLOCKS, bs, hkv, d, name), jnp.dtype(name)), bs


def attention_case(model: str, bucket: str, kv: str, tp: int, max_model_len: int = 4096) -> Case:
    """The attention kernel as the runner calls it (``for_step``, tpu-fused pages, bf16 q)."""
    import pallas_kernels

    tp, hq, hkv = per_device(*MODELS[model][:2], tp)
    d = MODELS[model][2]
    num_tokens, num_seqs, decode = BUCKETS[bucket]
    pages, bs = _pages(kv, hkv, d)
    max_blocks = max_model_len // bs
    i32 = jnp.int32
    args = (S((num_tokens, hq, d), jnp.bfloat16), pages, S((num_seqs,), i32), S((num_seqs + 1,), i32),
            S((num_seqs, max_blocks), i32), S((1,), i32))
    step = pallas_kernels.for_step(decode_only=decode, backend="tpu")

    def fn(q, pages, seq_lens, qsl, tables, n):
        return step(q, pages, None, seq_lens, qsl, tables, n, sm_scale=d ** -0.5)

    data = pages.data if isinstance(pages, QuantPages) else pages
    sizes = tpu.block_sizes(decode, hq // hkv, bs, num_kv_heads=hkv, head_dim=d, itemsize=data.dtype.itemsize)
    rows = tpu_budget.round_up(sizes["block_q"] * (hq // hkv), tpu.sublanes(jnp.bfloat16))
    est = tpu.vmem_estimate(num_kv_heads=hkv, rows=rows, head_dim=d, q_dtype=jnp.bfloat16,
                            kv_dtype=data.dtype, block_size=bs, pages_per_chunk=sizes["pages_per_chunk"],
                            quantized=isinstance(pages, QuantPages))
    smem = tpu.smem_estimate(num_seqs=num_seqs, max_blocks=max_blocks,
                             num_tiles=-(-num_tokens // sizes["block_q"]))
    return Case("attention", model, bucket, kv, tp, max_model_len, fn, args, est,
                tpu_budget.vmem_limit(est), smem)


def write_case(model: str, num_tokens: int, kv: str, tp: int) -> Case:
    """The fused KV write (``pallas_kernels.write_kv`` on tpu-fused pages), quantizing for int8/fp8."""
    import pallas_kernels

    tp, _, hkv = per_device(*MODELS[model][:2], tp)
    d = MODELS[model][2]
    pages, bs = _pages(kv, hkv, d)
    new = S((num_tokens, hkv, d), jnp.bfloat16)
    args = (pages, new, new, S((num_tokens,), jnp.int32))

    def fn(pages, k, v, slots):
        return pallas_kernels.write_kv(pages, None, k, v, slots, backend="tpu")[0]

    data = pages.data if isinstance(pages, QuantPages) else pages
    est = kv_write.fused_vmem_estimate(hkv, d, bs, data.dtype)
    return Case("kv_write", model, f"T{num_tokens}", kv, tp, 0, fn, args, est,
                tpu_budget.vmem_limit(est), tpu_budget.smem_array_bytes(num_tokens) + 512)


def cases(models=tuple(MODELS), kv_dtypes=tuple(KV_DTYPES), tps=(1, 8), long_context: bool = True
          ) -> Iterator[Case]:
    """Every kernel x model x bucket x KV dtype x tp, plus the 128k-context decode (tables split
    over calls) for the first model."""
    for model in models:
        for kv in kv_dtypes:
            for tp in tps:
                for bucket in BUCKETS:
                    yield attention_case(model, bucket, kv, tp)
                for num_tokens in (512, 1):
                    yield write_case(model, num_tokens, kv, tp)
    if long_context:
        yield attention_case(models[0], "T64 S64 decode", kv_dtypes[0], tps[0], max_model_len=131072)


def run(case: Case, topology: str = "v5e:2x2") -> dict:
    """Compile one case for ``topology``; the row of the compile table."""
    result = compile_check.tpu_compile_check(case.fn, case.args, topology)
    chip = topology.split(":")[0]
    return {"kernel": case.kernel, "model": case.model, "bucket": case.bucket, "kv": case.kv,
            "tp": case.tp, "max_model_len": case.max_model_len, "chip": chip, **result,
            "vmem_estimate": case.vmem_estimate, "vmem_limit": case.vmem_limit,
            "vmem_capacity": tpu_budget.CHIPS[chip].vmem, "smem_bytes": case.smem_bytes,
            "smem_capacity": tpu_budget.CHIPS[chip].smem}


