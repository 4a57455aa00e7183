"""Time the linear layers' native matmul per weight format: float32 panels against int8, fp8, Q8_0
and Q4_1 (csrc/quant_matmul.cc, which decodes each weight in registers), bfloat16, W8A8 and W4A8
(csrc/dot_matmul.cc, on the dot-product instructions cpu_kernels.kernel_paths() names).

`jaxserve bench quant_matmul --out bench/out/quant_matmul.json`

Shapes, rows and weight rotation as in `jaxserve bench matmul` (SmolLM2-135M's layers). GFLOP/s =
2 M K N / median time; GB/s = the format's weight bytes / median time (what decoding streams).
"""

from __future__ import annotations

import argparse

from bench import common
from bench.matmul import LM_HEAD, SHAPES

FORMATS = ("float32", "int8", "fp8", "q8_0", "q4_1", "q4_k", "q6_k", "bfloat16", "w8a8", "w4a8", "q8a8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench quant_matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,64", help="comma-separated M values (default 1,8,64)")
    p.add_argument("--weights", type=int, default=8, help="distinct weight matrices per shape (default 8)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated (default {','.join(FORMATS)})")
    p.add_argument("--shapes", default=None, help="comma-separated KxN (default: SmolLM2-135M's layers)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per case (default 15)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runtime import cpu_kernels, quant, quant_params, weight_formats

    why = cpu_kernels.available()
    if why is not None:
        raise SystemExit(f"the native kernels cannot be built here ({why}); nothing to compare")
    isa = cpu_kernels.choose_isa()  # $JAXSERVE_CPU_ISA caps it, as for the engine's backend
    rng = np.random.default_rng(0)

    def timed(fn, x, ws):
        return common.median_seconds(fn, x, ws, repeats=args.repeats) / len(ws)

    run = {"float32": jax.jit(lambda x, ws: [cpu_kernels.cpu_matmul(x, w) for w in ws]),
           "quant": jax.jit(lambda x, ws: [quant.linear(x, w, native=True, isa=isa) for w in ws])}
    formats = [f for f in FORMATS if f in args.formats.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    print("kernel paths:", cpu_kernels.kernel_paths(isa))
    results = []
    for k, n in shapes:
        floats = [rng.standard_normal((k, n)).astype(np.float32) * 0.1
                  for _ in range(1 if (k, n) == LM_HEAD else args.weights)]
        weights = {f: [cpu_kernels.pack_kernel(jnp.asarray(w)) if f == "float32"
                       else jax.device_put(weight_formats.quantize(w, f))
                       for w in floats] for f in formats}
        for m in (int(v) for v in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            for f, ws in weights.items():
                t = timed(run["float32" if f == "float32" else "quant"], x, ws)
                results.append({"k": k, "n": n, "m": m, "format": f, "gflops": 2 * m * k * n / t / 1e9,
                                "weight_gb_s": quant_params.weight_bytes(ws[0]) / t / 1e9})
    print(common.table([(f"{r['k']} x {r['n']}", r["m"], r["format"], r["gflops"], r["weight_gb_s"])
                        for r in results], ("K x N", "M", "format", "GFLOP/s", "weight GB/s"),
                       "Linear-layer matmul per weight format (native kernels)"))
    common.report("quant_matmul", argv, model={"shapes": shapes, "kernel_paths": cpu_kernels.kernel_paths(isa)},
                  config=vars(args), results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
