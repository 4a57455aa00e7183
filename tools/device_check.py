"""GPU check for the Pallas ragged paged attention kernel (run via tools/device_check.sh).

On one NVIDIA GPU (written for H200) with JAX installed and no network: (1) numerics of the
Mosaic GPU kernel against the jnp reference on small ragged batches, (2) kernel vs the engine's
`xla` backend at decode and prefill shapes, with achieved HBM GB/s (K/V bytes the batch must
read + q + out) next to measured device copy bandwidth. Prints a table and writes JSON.
Every step catches its own failure and records it, so one bad shape never hides the rest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import gpu, reference  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DTYPE = jnp.bfloat16

# name, q_lens, kv_lens
TIMED = [
    ("decode b64 ctx2k", [1] * 64, [2048] * 64),
    ("decode b256 ctx1k", [1] * 256, [1024] * 256),
    ("decode b32 ctx8k", [1] * 32, [8192] * 32),
    ("prefill 4x512", [512] * 4, [512] * 4),
    ("chunked 2x1k @4k", [1024] * 2, [4096] * 2),
    ("mixed 1x512+63 dec", [512] + [1] * 63, [1024] + [2048] * 63),
]
CHECKED = [
    ("ragged small", [1, 17, 16, 33, 0], [1, 17, 48, 40, 5]),
    ("decode mixed lens", [1] * 16, list(range(1, 400, 25))),
    ("prefill+decode", [100, 1, 1, 64], [100, 300, 16, 128]),
]


def make_batch(rng, q_lens, kv_lens, pad_seqs=2):
    num_seqs = len(q_lens)
    pages = [-(-kv // BLOCK) for kv in kv_lens]
    max_blocks = max(pages) + 1
    num_blocks = sum(pages) + 8
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_seqs + pad_seqs, max_blocks), np.int32)
    at = 0
    for s, n in enumerate(pages):
        tables[s, :n] = perm[at : at + n]
        at += n
    qsl = np.zeros(num_seqs + pad_seqs + 1, np.int32)
    qsl[1 : num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1 :] = qsl[num_seqs]
    seq_lens = np.zeros(num_seqs + pad_seqs, np.int32)
    seq_lens[:num_seqs] = kv_lens
    tokens = int(qsl[-1])
    tokens_pad = max(16, 1 << (tokens - 1).bit_length())
    key = jax.random.key(int(rng.integers(1 << 30)))
    k1, k2, k3 = jax.random.split(key, 3)
    kv_shape = (num_blocks, BLOCK, HKV, D)
    args = (
        jax.random.normal(k1, (tokens_pad, HQ, D), DTYPE),
        jax.random.normal(k2, kv_shape, DTYPE),
        jax.random.normal(k3, kv_shape, DTYPE),
        jnp.asarray(seq_lens),
        jnp.asarray(qsl),
        jnp.asarray(tables),
        jnp.asarray([num_seqs], jnp.int32),
    )
    itemsize = jnp.dtype(DTYPE).itemsize
    kv_bytes = 2 * sum(kv_lens) * HKV * D * itemsize
    qo_bytes = 2 * tokens * HQ * D * itemsize
    return args, tokens, kv_bytes + qo_bytes


def bench(fn, args, iters=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def copy_bandwidth(gib=2.0):
    n = int(gib * (1 << 30) / 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    sec, _ = bench(f, (x,), iters=10)
    return 2 * n * 4 / sec / 1e9  # read + write


def max_rel_err(out, ref, tokens):
    out = np.asarray(out[:tokens], np.float32)
    ref = np.asarray(ref[:tokens], np.float32)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="device_check.json")
    ap.add_argument("--pages-per-chunk", type=int, default=4)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="exercise this script on CPU: interpret mode, tiny shapes")
    opts = ap.parse_args()
    global TIMED, CHECKED
    if opts.cpu_smoke:
        TIMED = [("smoke decode", [1] * 4, [40] * 4), ("smoke prefill", [33], [33])]
        CHECKED = CHECKED[:1]
    dev = jax.devices()[0]
    report = {"device": str(getattr(dev, "device_kind", dev)), "jax": jax.__version__,
              "platform": dev.platform, "checks": [], "timings": []}
    print(f"device: {report['device']}  jax {jax.__version__}")
    if dev.platform != "gpu" and not opts.cpu_smoke:
        print("no GPU visible to JAX; nothing to check")
        report["error"] = "no GPU"
        json.dump(report, open(opts.json, "w"), indent=2)
        return 1
    kw = dict(sm_scale=D**-0.5)
    kernel = jax.jit(functools.partial(
        gpu.ragged_paged_attention, pages_per_chunk=opts.pages_per_chunk,
        interpret=opts.cpu_smoke, **kw))
    try:
        from jaxserve.runtime.attention import xla_ragged_paged_attention as xla_fn
    except ImportError:  # engine not importable: time the jnp reference instead
        xla_fn = reference.ragged_paged_attention
    xla = jax.jit(functools.partial(xla_fn, **kw))
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))
    rng = np.random.default_rng(0)

    try:
        report["copy_gbps"] = copy_bandwidth(0.0625 if opts.cpu_smoke else 2.0)
    except Exception as e:  # noqa: BLE001
        report["copy_gbps"] = None
        print("copy bandwidth failed:", e)
    print(f"measured copy bandwidth: {report['copy_gbps']:.0f} GB/s" if report["copy_gbps"]
          else "")

    print(f"\n{'numerics vs reference':<24}{'max rel err':>12}  status")
    for name, q_lens, kv_lens in CHECKED:
        row = {"name": name}
        try:
            args, tokens, _ = make_batch(rng, q_lens, kv_lens)
            f32 = tuple(a.astype(jnp.float32) if a.dtype == DTYPE else a for a in args)
            out = kernel(*args)
            err = max_rel_err(out, ref(*f32), tokens)
            pad_zero = bool(np.all(np.asarray(out[tokens:], np.float32) == 0))
            row.update(max_rel_err=err, padding_zero=pad_zero, ok=bool(err < 3e-2 and pad_zero))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        report["checks"].append(row)
        print(f"{name:<24}{row.get('max_rel_err', float('nan')):>12.2e}  "
              f"{'ok' if row['ok'] else 'FAIL ' + row.get('error', '')[:80]}")

    bw = report.get("copy_gbps") or float("nan")
    print(f"\n{'shape':<22}{'kernel ms':>10}{'xla ms':>9}{'speedup':>8}"
          f"{'kernel GB/s':>12}{'% copy':>8}{'xla GB/s':>10}{'rel err':>9}")
    for name, q_lens, kv_lens in TIMED:
        row = {"name": name, "tokens": sum(q_lens), "kv_tokens": sum(kv_lens)}
        try:
            args, tokens, nbytes = make_batch(rng, q_lens, kv_lens)
            row["bytes"] = nbytes
            tx, out_x = bench(xla, args)
            row.update(xla_ms=tx * 1e3, xla_gbps=nbytes / tx / 1e9)
            tk, out_k = bench(kernel, args)
            row.update(kernel_ms=tk * 1e3, kernel_gbps=nbytes / tk / 1e9,
                       rel_err_vs_xla=max_rel_err(out_k, out_x, tokens))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        report["timings"].append(row)
        g = row.get
        nan = float("nan")
        print(f"{name:<22}{g('kernel_ms', nan):>10.3f}{g('xla_ms', nan):>9.3f}"
              f"{g('xla_ms', nan) / g('kernel_ms', nan):>8.2f}{g('kernel_gbps', nan):>12.0f}"
              f"{100 * g('kernel_gbps', nan) / bw:>7.0f}%{g('xla_gbps', nan):>10.0f}"
              f"{g('rel_err_vs_xla', nan):>9.1e}"
              + (f"  {row['error'][:60]}" if "error" in row else ""))
    json.dump(report, open(opts.json, "w"), indent=2)
    print(f"\nwrote {opts.json}")
    ok = all(c["ok"] for c in report["checks"]) and not any("error" in t for t in report["timings"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
