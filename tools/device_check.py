"""Accelerator check for jaxserve: one python3 script, no network, fits a 9-minute device lease.

Phases, each with its own deadline (a phase stops starting new measurements when its time is
up, so the whole run ends near the sum even when compiles are slow):

  env       jax, devices, memory stats, compute capability, the kernel gate's verdict
  copy      device copy bandwidth (bytes read + written), the ceiling for decode
  numerics  the Pallas kernels against the jnp reference at the served models' head shapes
            (NaN-poisoned unused pages; ||out - ref|| / ||ref||, NaN never passes)
  decode    decode attention GB/s over batch x context: general kernel, split-KV kernel, xla
  prefill   prefill attention TFLOP/s (causal FLOPs counted once)
  generate  LLM.generate end to end on a random-init model (8B-wide, 2 layers), tok/s

Every measurement is appended to a JSON-lines file as soon as it is made, so a run killed by
its timeout keeps what it measured. Usage (see tools/device_check.md):

  python3 tools/device_check.py --out $OUT/device_check.jsonl [--phases decode,prefill]
  python3 tools/device_check.py --cpu-smoke   # the same code on CPU, interpreters, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pallas_kernels
from pallas_kernels import reference
from tests.kernels.batch import MODELS, make_batch

DEADLINES = {"env": 20, "copy": 25, "numerics": 120, "decode": 170, "prefill": 60, "generate": 120}
SHAPE_8B = (32, 8, 128)  # Llama-3-8B's (Hq, Hkv, D)
BLOCK = 16


class Recorder:
    """Appends one JSON object per line and flushes, so nothing measured is lost."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []
        open(path, "a").close()

    def __call__(self, phase: str, **row) -> dict:
        row = {"phase": phase, "t": round(time.time(), 2), **row}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        brief = {k: v for k, v in row.items() if k not in ("phase", "t", "traceback")}
        print(f"[{phase}] {json.dumps(brief, default=str)[:300]}", flush=True)
        return row


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
    kw = {"interpret": opts.cpu_smoke, "backend": opts.kernel_backend}
    out = {"general": pallas_kernels.for_step(decode_only=False, **kw)}
    if opts.kernel_backend == "gpu":
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
    copy = [r["gbps"] for r in rec.rows if r["phase"] == "copy" and "gbps" in r]
    ceiling = max(copy) if copy else None
    hq, hkv, d = SHAPE_8B
    xla_name, xla_fn = xla_attention()
    fns = {**kernels(opts), xla_name: xla_fn}
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
    from tests.tiny_models import make_tiny_model

    hidden, layers = (64, 1) if opts.cpu_smoke else (4096, 2)
    path = make_tiny_model(tempfile.mkdtemp() + "/m", "llama", layers=layers, hidden=hidden,
                           heads=32 if hidden >= 4096 else 4, kv_heads=8 if hidden >= 4096 else 2,
                           max_pos=4096)
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


PHASES = {"env": phase_env, "copy": phase_copy, "numerics": phase_numerics,
          "decode": phase_decode, "prefill": phase_prefill, "generate": phase_generate}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "device_check.jsonl"))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every phase deadline")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every phase on CPU: kernels in their interpreters, tiny shapes")
    opts = ap.parse_args(argv)
    platform = jax.devices()[0].platform
    opts.kernel_backend = "tpu" if platform == "tpu" else "gpu"
    opts.kernel_platform = opts.kernel_backend
    if opts.cpu_smoke:
        global ITERS
        ITERS = 1
        opts.copy_gib, opts.decode_sweep = [1 / 64], [(2, 64)]
        opts.prefill_sweep, opts.generate_sweep = [[32]], [(2, 8, 4)]
    else:
        opts.copy_gib = [1.0, 4.0]
        opts.decode_sweep = [(b, c) for c in (2048, 1024, 8192) for b in (32, 64, 1, 8, 128, 256)]
        opts.prefill_sweep = [[512] * 4, [2048], [4096] * 2]
        opts.generate_sweep = [(64, 1024, 32), (256, 1024, 16), (1, 512, 64)]
    if platform == "cpu" and not opts.cpu_smoke:
        print("jax sees no accelerator (use --cpu-smoke to exercise the script on CPU)")
    rec = Recorder(opts.out)
    failed = False
    for name in opts.phases.split(","):
        start = time.time()
        deadline = start + DEADLINES[name] * opts.scale
        try:
            fn = PHASES[name]
            fn(rec, opts) if name == "env" else fn(rec, opts, deadline)
        except Exception as e:  # noqa: BLE001 -- one phase's failure must not hide the next
            failed = True
            rec(name, error=f"{type(e).__name__}: {e}"[:1500],
                traceback=traceback.format_exc()[-3000:])
        rec(name, phase_seconds=round(time.time() - start, 1))
    bad = [r for r in rec.rows if r.get("ok") is False or "error" in r]
    print(f"\n{len(rec.rows)} rows in {opts.out}; {len(bad)} failed")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
