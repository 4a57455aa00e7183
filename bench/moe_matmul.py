"""The routed experts' grouped matmul (runtime/moe.py, over token->expert assignments sorted by
expert: `jax.lax.ragged_dot`, and the tiled `blocked_ragged_dot` the CPU backend uses) against a
dense gated MLP of the same FLOPs.

`jaxserve bench moe_matmul --out bench/out/moe_matmul.json`

At T tokens with top-k routing over E experts (hidden H, expert width I), the grouped step does
2 * 3 * T * k * H * I useful FLOPs; the dense baseline runs one [T*k, H] x [H, I] gated MLP (the
same rows, one weight set), so efficiency = dense time / grouped time (1.0: the grouping, sort and
combine cost nothing). `--impls ragged` adds XLA's ragged_dot (on CPU a dense product over every
expert: slow). The grouped time includes routing's sort, gather and weighted combine.
`--formats bfloat16,w8a8,w4a8,q8_0,q4_k,mxfp4,mxfp4a8` adds experts kept in those weight formats (an
ExpertStack: runtime/expert_matmul.py's native grouped calls), each against the dense native kernel
of the same format over the same rows (quant.linear_gated, then quant.linear); `mxfp4-tiled` is
gpt-oss's MXFP4 as loaded through the tiled loop that decodes one expert per tile (the path before
the native kernel); `mxfp4a8` is the same MXFP4 bytes times int8 activations on the dot-product
instructions (csrc/dot_matmul.cc kMXFP4A8, `--quantization mxfp4a8`). A K-quant falls back for a K
not in its super-blocks as --quantization does
(q4_k: the down projection's K = I = 384 as q4_1).
Default shapes: a Qwen3-30B-A3B layer cut down to fit this CPU (H 1024, I 384, 32 experts, top 4).
"""

from __future__ import annotations

import argparse

from bench import common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench moe_matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="16,64,256", help="comma-separated T values (default 16,64,256)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=384, help="each expert's width I")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--impls", default="blocked", help="comma-separated: blocked, ragged (default blocked)")
    p.add_argument("--formats", default="", help="comma-separated weight formats of packed experts (native grouped "
                   "calls), e.g. bfloat16,w8a8,w4a8,q8_0,q4_k (default none)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (default 20)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import functools

    from jaxserve.runtime import cpu_kernels, mxfp4, quant
    from jaxserve.runtime.expert_matmul import packed_moe
    from jaxserve.runtime.moe import blocked_ragged_dot, grouped_experts
    from jaxserve.runtime.quant_params import K_FALLBACK
    from jaxserve.runtime.weight_formats import ExpertStack, block_of, quantizable, quantize, stack_experts

    h, i, e, k = args.hidden, args.intermediate, args.experts, args.top_k
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def weights(*shape):
        return jnp.asarray(rng.standard_normal(shape) * shape[-2] ** -0.5, dt)

    w_gate, w_up, w_down = weights(e, h, i), weights(e, h, i), weights(e, i, h)
    impls = {"blocked": blocked_ragged_dot, "ragged": jax.lax.ragged_dot}
    grouped = {name: jax.jit(functools.partial(grouped_experts, matmul=impls[name])) for name in args.impls.split(",")}
    dense = jax.jit(lambda x, g, u, d: (jax.nn.silu(x @ g) * (x @ u)) @ d)
    packed = {}  # format -> (grouped fn, dense fn, (gate, up, down) stacks)
    isa = cpu_kernels.choose_isa() if args.formats and cpu_kernels.available() is None else None
    for name in filter(None, args.formats.split(",")):
        if name == "mxfp4-tiled":  # gpt-oss's MXFP4 as loaded, through the tiled loop (the xla backend's path)
            hf = [mxfp4.quantize(np.asarray(w, np.float32)) for w in (w_gate, w_up, w_down)]
            one = [mxfp4.quantize_panels(mxfp4.decode_numpy(x.blocks[0], x.scales[0]).T) for x in hf]
            packed[name] = (jax.jit(functools.partial(grouped_experts, matmul=blocked_ragged_dot)),
                            jax.jit(lambda x, g, u, d: quant.linear(quant.linear_gated(x, g, u, isa=isa), d, isa=isa)),
                            [type(x)(*map(jnp.asarray, x)) for x in hf], [type(o)(*map(jnp.asarray, o)) for o in one])
            continue
        stacks = []
        for w in (w_gate, w_up, w_down):
            kind = name if quantizable(w.shape[1:], block_of(name)) else K_FALLBACK.get(name, name)
            s = stack_experts([quantize(np.asarray(w[j], np.float32), kind) for j in range(e)])
            stacks.append(ExpertStack(type(s.w)(*map(jnp.asarray, s.w))))
        one = [type(s.w)(*(a[0] for a in s.w)) for s in stacks]  # expert 0's weights: the dense baseline
        packed[name] = (jax.jit(packed_moe(None, native=isa is not None, isa=isa)),
                        jax.jit(lambda x, g, u, d: quant.linear(quant.linear_gated(x, g, u, isa=isa), d, isa=isa)),
                        stacks, one)
    results = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((t, h)), dt)
        ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
        w = jnp.asarray(rng.random((t, k)), jnp.float32)
        rows = jnp.asarray(rng.standard_normal((t * k, h)), dt)
        gflop = 2 * 3 * t * k * h * i / 1e9
        t_dense = common.median_seconds(dense, rows, w_gate[0], w_up[0], w_down[0], repeats=args.repeats)
        for name, fn in grouped.items():
            t_grouped = common.median_seconds(fn, x, ids, w, w_gate, w_up, w_down, repeats=args.repeats)
            results.append({"impl": name, "tokens": t, "rows": t * k, "grouped_ms": 1e3 * t_grouped,
                            "dense_ms": 1e3 * t_dense, "grouped_gflops": gflop / t_grouped,
                            "dense_gflops": gflop / t_dense, "efficiency": t_dense / t_grouped})
        xf = x.astype(jnp.float32)
        for name, (fn, dense_fn, stacks, one) in packed.items():
            t_grouped = common.median_seconds(fn, xf, ids, w, *stacks, repeats=args.repeats)
            t_dense = common.median_seconds(dense_fn, rows.astype(jnp.float32), *one, repeats=args.repeats)
            results.append({"impl": f"{name} (packed)", "tokens": t, "rows": t * k, "grouped_ms": 1e3 * t_grouped,
                            "dense_ms": 1e3 * t_dense, "grouped_gflops": gflop / t_grouped,
                            "dense_gflops": gflop / t_dense, "efficiency": t_dense / t_grouped})
    print(common.table([(r["impl"], r["tokens"], r["rows"], f"{r['grouped_ms']:.2f}", f"{r['dense_ms']:.2f}",
                         r["grouped_gflops"], r["dense_gflops"], f"{100 * r['efficiency']:.0f}%") for r in results],
                       ("impl", "T", "T*k rows", "grouped ms", "dense ms", "grouped GFLOP/s", "dense GFLOP/s",
                        "efficiency"),
                       f"MoE grouped matmul, H {h}, I {i}, {e} experts, top {k}, {args.dtype}"))
    common.report("moe_matmul", argv, model={"hidden": h, "intermediate": i, "experts": e, "top_k": k},
                  config=vars(args), results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
