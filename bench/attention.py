"""Time one layer of paged attention per backend on the default model's shapes.

`jaxserve bench attention --out bench/out/attention.json`

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64) with 16-token blocks. Each call
reads a different one of --layers page arrays (as the model's layers do), so the pages come from
memory, not from cache. The cpu backend runs once per attribute isa (--isas: 1 is bfloat16 pages'
AVX-512 BF16 dot products; float32 pages run isa 0 only). Reported per case: ms
per call (median of --repeats synced calls), the attention FLOPs (4 x visible context x head_dim
per query head and row) as GFLOP/s, and the KV bytes read as GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common

CASES = {
    # name: (new tokens per sequence, context per sequence incl. the new tokens: a list, or
    # "decode" = random 150-450, "mixed" = the first two are fresh prompts, the rest decode)
    "decode 64 rows, context 150-450": ([1] * 64, "decode"),
    "decode 32 rows, context 150-450": ([1] * 32, "decode"),
    "prefill 2 x 256 rows after a 256-token prefix": ([256, 256], [512, 512]),
    "prefill 448 rows (2 x 224, fresh) + 64 decodes": ([224, 224] + [1] * 64, "mixed"),
    # a step of a burst of 200-token prompts (bench vllm_tails' random): a prompt's tail, two whole, a head
    "prefill 512 rows of 200-token prompts": ([88, 200, 200, 24], [200, 200, 200, 24]),
}


def _problem(rng, q_lens, kv_lens, *, hq, hkv, d, bs, layers, dtype):
    import jax.numpy as jnp
    import numpy as np

    num_seqs = len(q_lens)
    max_blocks = max(-(-kv // bs) for kv in kv_lens)
    need = sum(-(-kv // bs) for kv in kv_lens)
    num_blocks = need + 1
    tables = np.zeros((num_seqs + 1, max_blocks), np.int32)
    perm, taken = rng.permutation(np.arange(1, num_blocks)), 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // bs)
        tables[s, :n] = perm[taken:taken + n]
        taken += n
    qsl = np.zeros(num_seqs + 2, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1] = qsl[num_seqs]
    seq_lens = np.zeros(num_seqs + 1, np.int32)
    seq_lens[:num_seqs] = kv_lens
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]), hq, d)), jnp.float32)
    pages = [tuple(jnp.asarray(rng.standard_normal((num_blocks, bs, hkv, d)), dtype) for _ in range(2))
             for _ in range(layers)]
    meta = (jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray(tables), jnp.asarray([num_seqs], jnp.int32))
    flops = sum(4 * hq * d * sum(kv - q_len + i + 1 for i in range(q_len)) for q_len, kv in zip(q_lens, kv_lens))
    kv_bytes = 2 * sum(kv_lens) * hkv * d * jnp.dtype(dtype).itemsize
    return q, pages, meta, flops, kv_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="cpu,xla", help="comma-separated attention backends (default cpu,xla)")
    p.add_argument("--kv-dtypes", default="float32,bfloat16", help="page dtypes (default float32,bfloat16)")
    p.add_argument("--layers", type=int, default=8, help="page arrays rotated through (default 8)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (default 20)")
    p.add_argument("--isas", default=None,
                   help="the cpu backend's attribute isa values, e.g. 0,1 (default: 0, and 1 where AVX-512 BF16 "
                        "is here: bfloat16 pages' dot products, csrc/attention_vec.h)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runtime import cpu_kernels
    from jaxserve.runtime.attention import get_backend

    if "cpu" in args.backends.split(",") and (why := cpu_kernels.available()) is not None:
        raise SystemExit(f"the native kernels cannot be built here ({why}); try --backends xla")
    hq, hkv, d, bs = 9, 3, 64, 16
    isas = [0]
    if "cpu" in args.backends.split(","):
        here = cpu_kernels.attention_isa(cpu_kernels.choose_isa("avx512"))
        isas = [int(i) for i in args.isas.split(",")] if args.isas else sorted({0, here})
    results = []
    # isa 1 is bfloat16 pages' path: float32 pages run isa 0 only
    runs = [(b, kv, i) for b in args.backends.split(",") for kv in args.kv_dtypes.split(",")
            for i in (isas if (b, kv) == ("cpu", "bfloat16") else [0])]
    for backend, kv_dtype, isa in runs:
        fn = get_backend(backend, isa=isa)
        attend = jax.jit(lambda q, k, v, *m, fn=fn: fn(q, k, v, *m, sm_scale=d ** -0.5))
        label = f"cpu isa {isa}" if backend == "cpu" else backend
        for name, (q_lens, ctx) in CASES.items():
            rng = np.random.default_rng(0)
            if ctx == "decode":
                kv_lens = [int(x) for x in rng.integers(150, 451, len(q_lens))]
            elif ctx == "mixed":
                kv_lens = q_lens[:2] + [int(x) for x in rng.integers(150, 451, len(q_lens) - 2)]
            else:
                kv_lens = ctx
            q, pages, meta, flops, kv_bytes = _problem(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, bs=bs,
                                                       layers=args.layers, dtype=jnp.dtype(kv_dtype))
            for k, v in pages:
                jax.block_until_ready(attend(q, k, v, *meta))
            times = []
            for i in range(args.repeats):
                k, v = pages[i % len(pages)]
                t0 = time.perf_counter()
                jax.block_until_ready(attend(q, k, v, *meta))
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            results.append({"backend": label, "kv_dtype": kv_dtype, "case": name, "ms": ms,
                            "gflops": flops / ms / 1e6, "kv_gbps": kv_bytes / ms / 1e6})
    print(common.table([(r["backend"], r["kv_dtype"], r["case"], f"{r['ms']:.2f}", r["gflops"], r["kv_gbps"])
                        for r in results],
                       ("backend", "KV dtype", "case", "ms per layer", "GFLOP/s", "KV GB/s"),
                       f"Paged attention, one layer ({hq}/{hkv} heads, head_dim {d}, block {bs})"))
    common.report("attention", argv, model={"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "block_size": bs},
                  config=vars(args), results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
