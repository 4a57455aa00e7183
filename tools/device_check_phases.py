"""The jax-side phases of tools/device_check.py (env, copy, numerics, decode, prefill, generate),
each run in a child process of its own (tools/device_check_worker.py)."""

from __future__ import annotations

import functools
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import reference
from tests.kernels.batch import MODELS, make_batch
from tools.device_check import make_model_dir
from tools.device_check_engine import phase_ptxas, phase_step8b

SHAPE_8B = (32, 8, 128)  # Llama-3-8B's (Hq, Hkv, D)
BLOCK = 16


def configure(opts) -> None:
    """The platform's kernels and each phase's sweep (tiny with --cpu-smoke)."""
    global ITERS
    platform = jax.devices()[0].platform
    opts.kernel_backend = "tpu" if platform == "tpu" else "gpu"
    opts.kernel_platform = opts.kernel_backend
    if opts.cpu_smoke:
        ITERS = 1
        opts.copy_gib, opts.decode_sweep = [1 / 64], [(2, 64)]
        opts.prefill_sweep, opts.generate_sweep = [[32]], [(2, 8, 4)]
        opts.step_sweep, opts.step_ctx = [1, 2], 32
    else:
        opts.copy_gib = [1.0, 4.0]
        opts.decode_sweep = [(b, c) for c in (2048, 1024, 8192) for b in (32, 64, 1, 8, 128, 256)]
        opts.prefill_sweep = [[512] * 4, [2048], [4096] * 2]
        opts.generate_sweep = [(64, 1024, 32), (256, 1024, 16), (1, 512, 64)]
        opts.step_sweep, opts.step_ctx = [1, 32, 64], 2048


def copy_gbps(rec) -> float | None:
    """The copy phase's best GB/s (this run's file), the ceiling for decode and the 8B step."""
    copy = [r["gbps"] for r in rec.earlier("copy") if "gbps" in r]
    return max(copy) if copy else None


ITERS = 10


def timed(fn, args, iters: int | None = None) -> float:
    """Median seconds of one call after a warm-up (compile) call, synchronised each time."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters or ITERS):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def rel_err(out, ref, tokens: int) -> float:
    out = np.asarray(out[:tokens], np.float64)
    ref = np.asarray(ref[:tokens], np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def device_batch(seed, q_lens, kv_lens, heads, dtype):
    """A large batch made on the device (host RNG would dominate the lease)."""
    hq, hkv, d = heads
    pages = [-(-kv // BLOCK) for kv in kv_lens]
    max_blocks, num_blocks = max(pages) + 1, sum(pages) + 8
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(q_lens), max_blocks), np.int32)
    at = 0
    for s, n in enumerate(pages):
        tables[s, :n] = perm[at:at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    kv_shape = (num_blocks, BLOCK, hkv, d)
    return (
        jax.random.normal(k1, (int(qsl[-1]), hq, d), dtype),
        jax.random.normal(k2, kv_shape, dtype),
        jax.random.normal(k3, kv_shape, dtype),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(qsl),
        jnp.asarray(tables),
        jnp.asarray([len(q_lens)], jnp.int32),
    )


def xla_attention():
    try:
        from jaxserve.runtime.attention import xla_ragged_paged_attention
        return "xla", xla_ragged_paged_attention
    except ImportError:
        return "reference", reference.ragged_paged_attention


def phase_env(rec, opts):
    dev = jax.devices()[0]
    from jaxserve.runtime import compat

    cc = compat.compute_capability(dev)
    row = {"jax": jax.__version__, "platform": dev.platform, "device_kind": dev.device_kind,
           "num_devices": jax.device_count(), "compute_capability": cc,
           "memory_stats": compat.memory_stats(dev),
           "accelerator_unused": compat.warn_if_accelerator_unused()}
    for name, (hq, hkv, d) in MODELS.items():
        reason = pallas_kernels.supported(opts.kernel_platform, dtype=jnp.bfloat16, head_dim=d,
                                          group=hq // hkv, block_size=BLOCK,
                                          compute_capability=cc or "9.0")
        if reason:
            row.setdefault("unsupported", {})[name] = reason
    rec("env", **row)


def phase_copy(rec, opts, deadline):
    for gib in opts.copy_gib:
        if time.time() > deadline:
            break
        n = int(gib * (1 << 30) / 4)
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        sec = timed(jax.jit(lambda a: a * 1.0001), (x,))
        rec("copy", gib=gib, ms=sec * 1e3, gbps=2 * n * 4 / sec / 1e9)
        del x


def kernels(opts):
    """The Pallas kernels of this child: its unit's family (general / split_kv), or all."""
    kw = {"interpret": opts.cpu_smoke, "backend": opts.kernel_backend}
    out = {}
    if opts.unit in (None, "general"):
        out["general"] = pallas_kernels.for_step(decode_only=False, **kw)
    if opts.unit in (None, "split_kv") and opts.kernel_backend == "gpu":
        out["split_kv"] = pallas_kernels.for_step(decode_only=True, **kw)
    return out


def phase_numerics(rec, opts, deadline):
    dtype = jnp.bfloat16
    batches = {"decode": ([1] * 6, [1, 16, 150, 700, 2049, 33]),
               "mixed": ([1, 40, 1, 7, 0], [300, 40, 1031, 90, 12])}
    if opts.cpu_smoke:
        batches = {"decode": ([1, 1], [1, 40]), "mixed": ([1, 9], [40, 9])}
    models = list(MODELS.items())[: 1 if opts.cpu_smoke else None]
    for name, heads in models:
        for case, (q_lens, kv_lens) in batches.items():
            for kname, fn in kernels(opts).items():
                if kname == "split_kv" and case != "decode":
                    continue
                if time.time() > deadline:
                    return rec("numerics", skipped="deadline")
                try:
                    b = make_batch(np.random.default_rng(len(name) + len(case)), q_lens, kv_lens,
                                   num_q_heads=heads[0], num_kv_heads=heads[1],
                                   head_dim=heads[2], block_size=BLOCK, dtype=dtype)
                    kw = {"sm_scale": heads[2] ** -0.5}
                    out = jax.jit(functools.partial(fn, **kw))(*b.args)
                    f32 = tuple(a.astype(jnp.float32) if a.dtype == dtype else a for a in b.args)
                    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*f32)
                    err = rel_err(out, ref, b.num_real_tokens)
                    pad_zero = bool(np.all(np.asarray(out[b.num_real_tokens:], np.float32) == 0))
                    rec("numerics", model=name, batch=case, kernel=kname, rel_err=err,
                        padding_zero=pad_zero, ok=bool(err < 1e-2 and pad_zero))
                except Exception as e:  # noqa: BLE001 -- record and go on to the next shape
                    rec("numerics", model=name, batch=case, kernel=kname, ok=False,
                        error=f"{type(e).__name__}: {e}"[:1500],
                        traceback=traceback.format_exc()[-3000:])


def phase_decode(rec, opts, deadline):
    ceiling = copy_gbps(rec)
    hq, hkv, d = SHAPE_8B
    fns = kernels(opts)
    if opts.unit in (None, "xla"):
        xla_name, xla_fn = xla_attention()
        fns[xla_name] = xla_fn
    for batch, ctx in opts.decode_sweep:
        if time.time() > deadline:
            return rec("decode", skipped="deadline")
        args = device_batch(batch * 7 + ctx, [1] * batch, [ctx] * batch, SHAPE_8B, jnp.bfloat16)
        nbytes = 2 * batch * ctx * hkv * d * 2 + 2 * batch * hq * d * 2  # K+V read, q+out
        for kname, fn in fns.items():
            if time.time() > deadline:
                break
            try:
                sec = timed(jax.jit(functools.partial(fn, sm_scale=d ** -0.5)), args)
                gbps = nbytes / sec / 1e9
                rec("decode", batch=batch, ctx=ctx, kernel=kname, us=sec * 1e6, gbps=gbps,
                    pct_copy=100 * gbps / ceiling if ceiling else None)
            except Exception as e:  # noqa: BLE001
                rec("decode", batch=batch, ctx=ctx, kernel=kname,
                    error=f"{type(e).__name__}: {e}"[:1500])
        del args


def phase_prefill(rec, opts, deadline):
    hq, _, d = SHAPE_8B
    for lens in opts.prefill_sweep:
        if time.time() > deadline:
            return rec("prefill", skipped="deadline")
        args = device_batch(sum(lens), lens, lens, SHAPE_8B, jnp.bfloat16)
        flops = sum(4 * hq * d * n * (n + 1) / 2 for n in lens)  # QK^T + PV over the causal half
        for kname, fn in kernels(opts).items():
            if kname == "split_kv":
                continue
            try:
                sec = timed(jax.jit(functools.partial(fn, sm_scale=d ** -0.5)), args)
                rec("prefill", seqs=lens, kernel=kname, ms=sec * 1e3, tflops=flops / sec / 1e12)
            except Exception as e:  # noqa: BLE001
                rec("prefill", seqs=lens, kernel=kname, error=f"{type(e).__name__}: {e}"[:1500])


def phase_generate(rec, opts, deadline):
    """The engine end to end: random weights, 8B-wide layers, greedy decode of a batch."""
    from jaxserve import LLM, SamplingParams

    hidden, layers = (64, 1) if opts.cpu_smoke else (4096, 2)
    big = hidden >= 4096
    path = make_model_dir(tempfile.mkdtemp(prefix="dc-gen-"), layers=layers, hidden=hidden,
                          heads=32 if big else 4, kv_heads=8 if big else 2,
                          intermediate=14336 if big else 128, max_pos=4096)
    for batch, prompt_len, new in opts.generate_sweep:
        if time.time() > deadline:
            return rec("generate", skipped="deadline")
        try:
            # No precompile of every bucket (minutes of Mosaic compiles); a warm-up pass over the
            # same prompts compiles the buckets the timed pass uses.
            llm = LLM(str(path), max_model_len=prompt_len + new + 16, max_num_seqs=batch,
                      precompile=False)
            prompts = [[5 + (i + j) % 300 for j in range(prompt_len)] for i in range(batch)]
            params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                         use_tqdm=False)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sec = time.perf_counter() - t
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            rec("generate", batch=batch, prompt_len=prompt_len, new_tokens=new, layers=layers,
                hidden=hidden, seconds=sec, tokens=made, tok_per_s=made / sec,
                ok=made == batch * new)
            del llm
        except Exception as e:  # noqa: BLE001
            rec("generate", batch=batch, prompt_len=prompt_len, ok=False,
                error=f"{type(e).__name__}: {e}"[:1500], traceback=traceback.format_exc()[-3000:])


PHASES = {"env": phase_env, "copy": phase_copy, "numerics": phase_numerics, "step8b": phase_step8b,
          "decode": phase_decode, "ptxas": phase_ptxas, "prefill": phase_prefill, "generate": phase_generate}
