"""`jaxserve bench roofline`: this machine's limits, and the model's throughput ceilings under them.

Measures (with JAX):
  * matmul GFLOP/s (GOP/s for int8) for decode-sized dots (B x d @ d x intermediate, one per batch
    size asked) and for a large square dot, in each precision the machine can run: float32 (the
    faster of XLA's dot and, on CPU, the native packed-panel kernel), bfloat16 and int8 (on CPU the
    native dot-product kernels of csrc/dot_matmul.cc: bfloat16 weights and activations with
    float32 sums, W8A8 with int32 sums, on AVX512_BF16 / AVX512_VNNI where the CPU has them;
    elsewhere XLA's dot in that dtype). Every rate is recorded; the ceilings use the fastest
    precision at each size, so "% of roofline" is taken against the best the hardware offers;
  * memory bandwidth: read (a sum over a large array) and copy (read + write) GB/s.
From a ModelConfig it computes FLOPs per token (every matmul incl. the lm head, plus attention over
`--context` cached tokens) and bytes per decode step (all weights once, plus each sequence's KV
cache), then prints:
  * compute ceiling  = matmul GFLOP/s at batch B / GFLOP per token          (tok/s)
  * bandwidth ceiling = B * GB/s / (weight bytes + B * KV bytes)             (tok/s)
    (GB/s: the better of read and copy, so the ceiling is an upper bound)
  * the roofline = min of the two; single-stream decode (B=1) is bandwidth-bound.

Other tools call `measure()` once and `ceilings(cfg, batch, context, measured)` to show results
as a fraction of the limit.

    jaxserve bench roofline [--model PATH] [--batch 1,16,64] [--context 512] [--dtype float32] [--out f.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

from bench import common


# ---- model arithmetic ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCosts:
    params_matmul: int  # weights used in matmuls per token (layers + lm head)
    params_lm_head: int  # part of params_matmul: only paid by tokens whose logits are computed
    params_total: int  # incl. embedding (when untied) and norms
    flops_per_token: float  # at the given context
    flops_attention: float  # part of flops_per_token
    weight_bytes: int  # bytes read per decode step (every weight once; embedding only a row if untied)
    kv_bytes_per_token_ctx: float  # KV bytes read per sequence per step at the given context
    context: int
    dtype_bytes: int
    kv_dtype_bytes: int


def model_costs(cfg, context: int = 512, dtype_bytes: int = 4, kv_dtype_bytes: int | None = None) -> ModelCosts:
    """FLOPs and bytes for one token of a Llama-family model with `context` tokens already cached
    (weights of `dtype_bytes`, KV of `kv_dtype_bytes`, default the same)."""
    kv_dtype_bytes = kv_dtype_bytes or dtype_bytes
    d, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q = d * cfg.num_heads * hd
    kv = 2 * d * cfg.num_kv_heads * hd
    o = cfg.num_heads * hd * d
    mlp = 3 * d * cfg.intermediate_size
    layer = q + kv + o + mlp
    lm_head = d * cfg.vocab_size
    params_matmul = L * layer + lm_head
    norms = L * 2 * d + d + (L * 2 * hd if cfg.qk_norm else 0)
    bias = L * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd if cfg.attention_bias else 0
    embed = 0 if cfg.tie_word_embeddings else d * cfg.vocab_size
    params_total = params_matmul + norms + bias + embed
    attn = 4.0 * L * cfg.num_heads * hd * context  # q.k over the context, then p.v
    flops = 2.0 * params_matmul + attn
    # A decode step reads every matmul weight once (the untied embedding table: one row per token).
    weight_bytes = (params_matmul + norms + bias) * dtype_bytes
    kv_ctx = 2.0 * L * cfg.num_kv_heads * hd * context * kv_dtype_bytes
    return ModelCosts(params_matmul, lm_head, params_total, flops, attn, weight_bytes, kv_ctx, context, dtype_bytes,
                      kv_dtype_bytes)


# ---- measurements -------------------------------------------------------------------------------
def _time(fn, *args, repeats: int, min_time: float) -> float:
    """Median seconds per call (after one warm-up call), at least `repeats` calls and `min_time` s."""
    import jax

    jax.block_until_ready(fn(*args))
    times, t_start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - t_start < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if len(times) > 10_000:
            break
    return statistics.median(times)


PRECISIONS = ("float32", "bfloat16", "int8")
_DOT_SCHEME = {"bfloat16": "bfloat16", "int8": "w8a8"}  # runtime/weight_formats.py's native format per precision


def matmul_gflops(m: int, k: int, n: int, dtype: str = "float32", repeats: int = 5, min_time: float = 0.3) -> dict:
    """{"xla": GFLOP/s of XLA's dot or None, "native": of the `cpu` backend's kernel or None} in
    precision `dtype` (float32, bfloat16 or int8: operands of that type, float32 / int32 sums).
    float32 measures both; bfloat16 and int8 measure the native kernel where it runs (CPU, the
    library built, a shape it takes) and XLA's dot only otherwise (XLA:CPU's int8 dot is slow)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runtime import cpu_kernels, quant, weight_formats

    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (m, k), jnp.float32)
    b = jax.random.normal(kb, (k, n), jnp.float32)
    gflop = 2.0 * m * k * n / 1e9
    rate = lambda f, *args: gflop / _time(jax.jit(f), *args, repeats=repeats, min_time=min_time)  # noqa: E731
    native_ok = jax.default_backend() == "cpu" and cpu_kernels.available() is None
    out = {"xla": None, "native": None}
    if dtype == "float32" and native_ok and cpu_kernels.packable(b.shape):
        out["native"] = rate(cpu_kernels.cpu_matmul, a, cpu_kernels.pack_kernel(b))
    elif dtype != "float32" and native_ok and weight_formats.quantizable(b.shape):
        w = jax.device_put(weight_formats.quantize(jax.device_get(b), _DOT_SCHEME[dtype]))
        isa = cpu_kernels.choose_isa()  # $JAXSERVE_CPU_ISA caps it, as for the engine's backend
        out["native"] = rate(lambda x, w: quant.linear(x, w, native=True, isa=isa), a, w)
    if dtype == "float32" or out["native"] is None:
        acc = jnp.int32 if dtype == "int8" else jnp.float32
        cast = (lambda v: jnp.clip(jnp.round(v * 30), -127, 127).astype(jnp.int8)) if dtype == "int8" else (
            lambda v: v.astype(dtype))
        out["xla"] = rate(lambda x, y: jnp.dot(x, y, preferred_element_type=acc), cast(a), cast(b))
    return out


def memory_gbps(nbytes: int = 256 << 20, repeats: int = 5, min_time: float = 0.3) -> dict:
    """{"read": GB/s of a float32 sum, "copy": GB/s (read + write bytes) of an in-place x * 1.0001}.

    The copy donates its input, so it measures streaming bandwidth, not the page faults of a fresh
    output buffer (an undonated elementwise op on CPU runs ~10x slower for that reason).
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    t_read = _time(jax.jit(jnp.sum), x, repeats=repeats, min_time=min_time)
    scale = jax.jit(lambda v: v * 1.0001, donate_argnums=0)
    state = [scale(x)]
    jax.block_until_ready(state[0])

    def step():
        state[0] = scale(state[0])
        return state[0]

    t_copy = _time(step, repeats=repeats, min_time=min_time)
    return {"read": nbytes / t_read / 1e9, "copy": 2 * nbytes / t_copy / 1e9, "bytes": nbytes}


def measure(cfg=None, batches=(1, 64), dtype: str = "float32", quick: bool = False,
            precisions: tuple[str, ...] = PRECISIONS) -> dict:
    """Matmul GFLOP/s per batch size (dots shaped like the model's MLP) and for a large square, in
    each of `precisions`, plus GB/s. `matmul_gflops[size]` is the fastest precision's rate (named in
    `matmul_precision`); `matmul_gflops_by_impl` keeps `dtype`'s per implementation (as before)."""
    d = cfg.hidden_size if cfg is not None else 576
    inter = cfg.intermediate_size if cfg is not None else 1536
    rep, mt = (3, 0.1) if quick else (5, 0.4)
    out = {"dtype": dtype, "matmul_gflops": {}, "matmul_precision": {}, "matmul_gflops_by_impl": {},
           "matmul_gflops_by_precision": {p: {} for p in precisions}, "matmul_shapes": {}}
    big = 1024 if quick else 2048
    shapes = {str(b): (int(b), d, inter) for b in sorted({int(b) for b in batches})} | {"large": (big, big, big)}
    for key, (m, k, n) in shapes.items():
        best = {}
        for prec in dict.fromkeys((dtype, *precisions)):
            by_impl = matmul_gflops(m, k, n, prec, rep, mt)
            if prec in precisions:
                out["matmul_gflops_by_precision"][prec][key] = by_impl
            if prec == dtype:
                out["matmul_gflops_by_impl"][key] = by_impl
            best[prec] = max(v for v in by_impl.values() if v is not None)
        prec = max(best, key=best.get)
        out["matmul_gflops"][key], out["matmul_precision"][key] = best[prec], prec
        out["matmul_shapes"][key] = f"{m}x{k} @ {k}x{n}"
    out["memory_gbps"] = memory_gbps((64 << 20) if quick else (256 << 20), rep, mt)
    return out


def _gflops_at(measured: dict, batch: int) -> float:
    """Measured GFLOP/s at this batch size (nearest measured batch at or below it; large for >= 256)."""
    g = measured["matmul_gflops"]
    sizes = sorted(int(k) for k in g if k != "large")
    if not sizes or (batch >= 256 and "large" in g):
        return g["large"]
    below = [s for s in sizes if s <= batch]
    return g[str(below[-1] if below else sizes[0])]


def ceilings(cfg, batch: int, context: int, measured: dict, dtype_bytes: int = 4,
             kv_dtype_bytes: int | None = None) -> dict:
    """Throughput ceilings (tok/s) for `batch` sequences decoding at `context` tokens."""
    c = model_costs(cfg, context, dtype_bytes, kv_dtype_bytes)
    gflops = _gflops_at(measured, batch)
    bw = max(measured["memory_gbps"]["read"], measured["memory_gbps"]["copy"])  # best streaming rate
    compute = gflops * 1e9 / c.flops_per_token
    step_bytes = c.weight_bytes + batch * c.kv_bytes_per_token_ctx
    bandwidth = batch * bw * 1e9 / step_bytes
    return {"batch": batch, "context": context, "gflop_per_token": c.flops_per_token / 1e9,
            "matmul_gflops": gflops, "bandwidth_gbps": bw, "weight_mb": c.weight_bytes / 1e6,
            "kv_mb_per_seq": c.kv_bytes_per_token_ctx / 1e6, "compute_tok_s": compute,
            "bandwidth_tok_s": bandwidth, "roofline_tok_s": min(compute, bandwidth),
            "bound": "compute" if compute < bandwidth else "bandwidth"}


def work_fraction(wall_s: float, prompt_tokens: int, output_tokens: int, cfg, batch: int, context: int,
                  measured: dict, dtype_bytes: int = 4) -> dict:
    """Ideal compute time / wall time for a whole run: prompt tokens pay the layers' matmuls and
    attention, sampled tokens also the lm head, all at the matmul rate measured at `batch`."""
    c = model_costs(cfg, context, dtype_bytes)
    layer_flops = 2.0 * (c.params_matmul - c.params_lm_head) + c.flops_attention
    flops = prompt_tokens * layer_flops + output_tokens * c.flops_per_token
    gflops = _gflops_at(measured, batch)
    ideal = flops / (gflops * 1e9)
    return {"gflop": flops / 1e9, "matmul_gflops": gflops, "ideal_s": ideal, "wall_s": wall_s,
            "achieved_gflops": flops / wall_s / 1e9, "fraction_of_compute": ideal / wall_s}


def fraction(tok_s: float, cfg, batch: int, context: int, measured: dict, dtype_bytes: int = 4,
             kv_dtype_bytes: int | None = None) -> dict:
    """A result as a fraction of the roofline at its batch and context."""
    c = ceilings(cfg, batch, context, measured, dtype_bytes, kv_dtype_bytes)
    return {**c, "measured_tok_s": tok_s, "fraction_of_roofline": tok_s / c["roofline_tok_s"]}


# ---- CLI ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--batch", default="1,8,16,32,64", help="comma-separated batch sizes (default 1,8,16,32,64)")
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence for attention/KV (512)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--kv-cache-dtype", default=None, choices=("float32", "bfloat16"),
                   help="KV bytes for the bandwidth ceiling (default: the engine's default for this model)")
    p.add_argument("--quick", action="store_true", help="shorter, smaller measurements (smoke tests)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b]

    from jaxserve.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    cfg = config_only(path)
    from jaxserve.runtime.kv_sizing import default_kv_cache_dtype, dtype_size

    args.kv_cache_dtype = args.kv_cache_dtype or default_kv_cache_dtype(args.dtype, cfg.checkpoint_dtype)
    dbytes, kvbytes = dtype_size(args.dtype), dtype_size(args.kv_cache_dtype)
    measured = measure(cfg, batches, args.dtype, args.quick)
    costs = model_costs(cfg, args.context, dbytes, kvbytes)

    from jaxserve.runtime import cpu_kernels

    by_prec = measured["matmul_gflops_by_precision"]
    rows = [(measured["matmul_shapes"][k], v, measured["matmul_precision"][k],
             *(by_prec[p][k][impl] for p in PRECISIONS for impl in ("xla", "native")))
            for k, v in measured["matmul_gflops"].items()]
    print(common.table(rows, ("matmul", "GFLOP/s (best)", "best precision", "f32 XLA", "f32 native", "bf16 XLA",
                              "bf16 native", "int8 XLA", "int8 native"),
                       f"Measured on this machine (GOP/s for int8; native kernels: {cpu_kernels.kernel_paths()})"))
    mem = measured["memory_gbps"]
    print(common.kv_table([("read GB/s (sum)", mem["read"]), ("copy GB/s (read+write)", mem["copy"])]))
    print(common.kv_table([
        ("matmul params (incl. lm head)", costs.params_matmul), ("params total", costs.params_total),
        ("GFLOP/token (matmuls)", 2 * costs.params_matmul / 1e9),
        (f"GFLOP/token (attention @ {args.context})", costs.flops_attention / 1e9),
        ("weight MB read per step", costs.weight_bytes / 1e6),
        (f"KV MB per sequence @ {args.context} ({args.kv_cache_dtype})", costs.kv_bytes_per_token_ctx / 1e6),
    ], f"Model {path.name}"))
    rows, results = [], []
    for b in batches:
        c = ceilings(cfg, b, args.context, measured, dbytes, kvbytes)
        results.append(c)
        rows.append((b, c["matmul_gflops"], c["compute_tok_s"], c["bandwidth_tok_s"], c["roofline_tok_s"], c["bound"]))
    print(common.table(rows, ("batch", "GFLOP/s (best precision)", "compute tok/s", "bandwidth tok/s", "roofline tok/s",
                              "bound"),
                       f"Ceilings at context {args.context} ({args.dtype}, KV {args.kv_cache_dtype})"))
    common.report("roofline", argv, model=common.model_info(path, cfg),
                  config=vars(args), results={"measured": measured, "costs": asdict(costs), "ceilings": results},
                  out=args.out)
    return 0


def config_only(path):
    """The ModelConfig without loading weights where possible (HF dir: config.json; GGUF: metadata)."""
    import json
    from pathlib import Path

    from jaxserve.model.config import ModelConfig

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"))
    if path.is_file() and path.suffix == ".gguf":
        from jaxserve.model.gguf_loader import GGUFFile, gguf_config

        return ModelConfig.from_hf(gguf_config(GGUFFile(path)), str(path))
    from jaxserve.model.loader import load_model

    return load_model(str(path)).config


if __name__ == "__main__":
    raise SystemExit(main())
