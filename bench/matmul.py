"""Time the linear layers' matmul: XLA's dot against the native packed-panel kernel (`cpu` backend).

`jaxserve bench matmul --out bench/out/matmul.json`

Shapes are SmolLM2-135M's linear layers (K x N): 576 x 1536 (gate/up), 1536 x 576 (down),
576 x 576 (q/o), 576 x 192 (k/v), and the tied LM head 576 x 49152 (113 MB: larger than L3), at M
rows (the step's tokens). Each call uses one of --weights distinct weight matrices in turn, as the
model's layers do (the LM head: one, as in the model). GFLOP/s = 2 M K N / median time.
"""

from __future__ import annotations

import argparse

from bench import common

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]
LM_HEAD = (576, 49152)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,24,64,512", help="comma-separated M values (default 1,8,24,64,512)")
    p.add_argument("--weights", type=int, default=8, help="distinct weight matrices per shape (default 8)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (default 20)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runtime import cpu_kernels

    why = cpu_kernels.available()
    if why is not None:
        raise SystemExit(f"the native kernels cannot be built here ({why}); nothing to compare")
    rng = np.random.default_rng(0)

    def timed(fn, x, ws):
        return common.median_seconds(fn, x, ws, repeats=args.repeats) / len(ws)

    xla = jax.jit(lambda x, ws: [x @ w for w in ws])
    native = jax.jit(lambda x, ws: [cpu_kernels.cpu_matmul(x, w) for w in ws])
    results = []
    for k, n in SHAPES:
        count = 1 if (k, n) == LM_HEAD else args.weights
        ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(count)]
        packed = [cpu_kernels.pack_kernel(w) for w in ws]
        for m in (int(v) for v in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            gflop = 2 * m * k * n / 1e9
            t_xla, t_native = timed(xla, x, ws), timed(native, x, packed)
            results.append({"k": k, "n": n, "m": m, "xla_gflops": gflop / t_xla, "native_gflops": gflop / t_native,
                            "speedup": t_xla / t_native})
    print(common.table([(f"{r['k']} x {r['n']}", r["m"], r["xla_gflops"], r["native_gflops"], f"{r['speedup']:.2f}x")
                        for r in results], ("K x N", "M", "XLA GFLOP/s", "native GFLOP/s", "speed-up"),
                       "Linear-layer matmul, float32"))
    common.report("matmul", argv, model={"shapes": SHAPES}, config=vars(args), results={"cases": results},
                  out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
