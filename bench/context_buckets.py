"""The xla attention path's context buckets (issue 24 item 7): a decode step of short contexts on
the block table of its context bucket vs the full max_model_len table, in the same run.

`jaxserve bench context_buckets --out bench/out/context_buckets.json`

Two measurements, each with the table narrow (the bucketed step: `BucketKey.c` = the smallest
context width that holds the longest context) and full (c = 0: max_model_len / block_size
columns, what every step used before):

- the engine's decode step (`ModelRunner.execute`, the default model unless --model, weights as
  loaded, attention_backend xla) at --rows sequences of --min-ctx..--max-ctx tokens: on XLA:CPU
  the xla path stops its loops at the batch's own extent, so the table's width costs only its
  gathers and the step's bytes;
- one layer of the xla attention with the loops bounded by the shapes (`static_bounds=True`, what a
  GPU or TPU runs when its Pallas kernels fall back to xla): there every row scans the table's
  whole width, so the width is the work.

Reported per case: median ms over --steps synced calls, and full / narrow.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common


def _timed(fn, steps: int) -> float:
    """Median seconds of `fn()` (which syncs) over `steps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_step(runner, rows, steps: int) -> dict:
    import jax

    out = {}
    for mode, on in (("narrow", True), ("full", False)):
        runner.builder.context_buckets = on
        batch, key, _ = runner.builder.build(rows)
        out[mode] = {"c": key.c, "table": list(batch.block_tables.shape),
                     "ms": 1e3 * _timed(lambda b=batch, k=key: jax.block_until_ready(runner.execute(b, k).tokens),
                                        steps)}
    runner.builder.context_buckets = runner.backend.context_buckets
    return out


def attention_layer(mc, batch, runner, steps: int) -> dict:
    """One layer's xla attention with shape-bounded loops on the step's own metadata."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runtime.attention import xla_ragged_paged_attention

    fn = jax.jit(functools.partial(xla_ragged_paged_attention, sm_scale=mc.head_dim ** -0.5, static_bounds=True))
    k_pages, v_pages = runner.kv.layers[0]
    t = batch.input_ids.shape[0]
    q = jnp.asarray(np.random.default_rng(0).standard_normal((t, mc.num_heads, mc.head_dim)), jnp.float32)
    out = {}
    for mode, width in (("narrow", None), ("full", runner.max_blocks)):
        tables = batch.block_tables if width is None else np.pad(
            batch.block_tables, ((0, 0), (0, width - batch.block_tables.shape[1])))
        args = (q, k_pages, v_pages, *map(jnp.asarray, (batch.seq_lens, batch.query_start_loc, tables,
                                                        batch.num_seqs)))
        out[mode] = {"c": int(tables.shape[1]), "table": list(tables.shape),
                     "ms": 1e3 * _timed(lambda a=args: jax.block_until_ready(fn(*a)), steps)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench context_buckets", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rows", default="8,32", help="comma-separated decode batch sizes (default 8,32)")
    p.add_argument("--min-ctx", type=int, default=100, help="shortest context in tokens (default 100)")
    p.add_argument("--max-ctx", type=int, default=250, help="longest context in tokens (default 250)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per case (default 20)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import numpy as np

    from jaxserve.core.batch import RowSpec, Sampling
    from jaxserve.model.loader import load_model
    from jaxserve.worker.runner import ModelRunner, RunnerConfig

    levels = [int(x) for x in args.rows.split(",")]
    bs = args.block_size
    per_seq = -(-args.max_ctx // bs)
    lm = load_model(args.model)
    mc = lm.config
    runner = ModelRunner(mc, lm.params, RunnerConfig(
        block_size=bs, num_blocks=max(levels) * per_seq + 1, max_model_len=args.max_model_len,
        max_num_seqs=max(levels), max_num_batched_tokens=max(512, max(levels)), attention_backend="xla"))
    rng = np.random.default_rng(0)
    results, table = [], []
    for n in levels:
        ctx = rng.integers(args.min_ctx, args.max_ctx + 1, n).tolist()
        rows = [RowSpec(rng.integers(5, mc.vocab_size - 5, c).tolist(), c - 1, 1,
                        list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), Sampling()) for i, c in enumerate(ctx)]
        step = engine_step(runner, rows, args.steps)
        runner.builder.context_buckets = True
        batch, _, _ = runner.builder.build(rows)
        layer = attention_layer(mc, batch, runner, args.steps)
        for what, r in (("engine decode step (XLA:CPU loops)", step),
                        ("one attention layer, shape-bounded loops (accelerator fallback)", layer)):
            results.append({"rows": n, "case": what, **{f"{m}_{k}": v for m in r for k, v in r[m].items()}})
            table.append((n, what, f"{r['narrow']['table'][1]} / {r['full']['table'][1]}", f"{r['narrow']['ms']:.2f}",
                          f"{r['full']['ms']:.2f}", f"{r['full']['ms'] / r['narrow']['ms']:.2f}x"))
    print(common.table(table, ("rows", "case", "table blocks narrow / full", "narrow ms", "full ms", "full / narrow"),
                       f"xla decode at max_model_len {args.max_model_len}, contexts {args.min_ctx}-{args.max_ctx} "
                       f"tokens, block {bs} ({mc.model_type}, {mc.num_layers} layers)"))
    common.report("context_buckets", argv, model=common.model_info(lm), config=vars(args),
                  results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
