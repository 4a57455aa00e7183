"""Time the on-device sampler per step: greedy, temperature, top-k, top-p on peaked and flat rows.

`jaxserve bench sampler --rows 64 --vocab 49152 --out bench/out/sampler.json`

Logits are synthetic: "peaked" rows are N(0, 7.5²) (the top 256 tokens hold nearly all the mass,
as for a language model's next token), "flat" rows N(0, 1) (top-p must look past the top 256
candidates and takes the exact full-vocabulary path). Median of --repeats synced calls.
"""

from __future__ import annotations

import argparse

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

    from jaxserve.core.batch import BatchBuilder
    from jaxserve.core.buckets import BucketKey
    from jaxserve.runtime.sampler import sample

    n = args.rows
    builder = BatchBuilder(max_num_batched_tokens=1, max_num_seqs=n, block_size=16, max_model_len=16,
                           vocab_size=args.vocab)

    def tensors(temperature, top_k=0, top_p=1.0, logprobs=-1):
        b = builder.empty(BucketKey(1, n, 0))
        b.temperature[:], b.top_k[:], b.top_p[:], b.num_logprobs[:] = temperature, top_k, top_p, logprobs
        b.seed_lo[:] = np.arange(n, dtype=np.uint32)
        return b

    base = jax.random.normal(jax.random.PRNGKey(0), (n, args.vocab))
    cases = [  # one compiled sampler serves every case (what each row asks is decided on device)
        ("greedy", base * 7.5, tensors(0.0)),
        ("greedy, logprobs 5", base * 7.5, tensors(0.0, logprobs=5)),
        ("temperature 0.7", base * 7.5, tensors(0.7)),
        ("temperature 0.7, top_p 0.9, peaked", base * 7.5, tensors(0.7, top_p=0.9)),
        ("temperature 1, top_k 50", base * 7.5, tensors(1.0, top_k=50)),
        ("temperature 1, top_p 0.95, flat", base, tensors(1.0, top_p=0.95)),
    ]
    fn = jax.jit(sample)
    cpu0 = common.cpu_seconds()
    fn.lower(*cases[0][1:]).compile()  # the sampler's share of every bucket's compile
    compile_cpu = common.cpu_seconds() - cpu0
    results = []
    for name, logits, t in cases:
        results.append({"case": name, "ms": 1e3 * common.median_seconds(fn, logits, t, repeats=args.repeats)})
    print(common.table([(r["case"], r["ms"]) for r in results], ("case", "ms per step"),
                       f"Sampler, {n} rows x {args.vocab} vocabulary"))
    print(f"compile: {compile_cpu:.2f} s of CPU (XLA:CPU, once per bucket)")
    common.report("sampler", argv, model={}, config=vars(args),
                  results={"cases": results, "compile_cpu_s": compile_cpu}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
