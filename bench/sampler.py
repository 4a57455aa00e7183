"""Time the on-device sampler per step: greedy, temperature, top-k, top-p on peaked and flat rows.

`jaxserve bench sampler --rows 64 --vocab 49152 --out bench/out/sampler.json`

Logits are synthetic: "peaked" rows are N(0, 7.5²) (the top 256 tokens hold nearly all the mass,
as for a language model's next token), "flat" rows N(0, 1) (top-p must look past the top 256
candidates and takes the exact full-vocabulary path). Median of --repeats synced calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="sampling rows per step (default 64)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152, SmolLM2's)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per case (default 10)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from jaxserve.runtime.sampler import SamplingMode, SamplingTensors, sample

    n = args.rows

    def tensors(temperature, top_k=0, top_p=1.0):
        full = lambda v, dt=np.float32: np.full(n, v, dt)  # noqa: E731
        empty = lambda dt=np.int32: np.zeros((n, 0), dt)  # noqa: E731
        return SamplingTensors(full(temperature), full(top_k, np.int32), full(top_p), full(0.0),
                               np.arange(n, dtype=np.uint32), full(0, np.int32), full(0.0), full(0.0), full(1.0),
                               empty(), empty(), empty(), empty(np.float32))

    base = jax.random.normal(jax.random.PRNGKey(0), (n, args.vocab))
    cases = [
        ("greedy", base * 7.5, tensors(0.0), SamplingMode()),
        ("temperature 0.7", base * 7.5, tensors(0.7), SamplingMode(all_greedy=False)),
        ("temperature 0.7, top_p 0.9, peaked", base * 7.5, tensors(0.7, top_p=0.9),
         SamplingMode(all_greedy=False, truncation=True)),
        ("temperature 1, top_k 50", base * 7.5, tensors(1.0, top_k=50), SamplingMode(all_greedy=False, truncation=True)),
        ("temperature 1, top_p 0.95, flat", base, tensors(1.0, top_p=0.95),
         SamplingMode(all_greedy=False, truncation=True)),
    ]
    fn = jax.jit(sample, static_argnums=2)
    results = []
    for name, logits, t, mode in cases:
        jax.block_until_ready(fn(logits, t, mode))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(logits, t, mode))
            times.append(time.perf_counter() - t0)
        results.append({"case": name, "ms": 1e3 * statistics.median(times)})
    print(common.table([(r["case"], r["ms"]) for r in results], ("case", "ms per step"),
                       f"Sampler, {n} rows x {args.vocab} vocabulary"))
    common.report("sampler", argv, model={}, config=vars(args), results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
