"""The engine-level phases of tools/device_check.py: ``llm`` (LLM() with default settings, first
in a fresh process), ``step8b`` (an 8B-shaped random-weight decode step against its roofline) and
``ptxas`` (each Mosaic GPU kernel's registers / spills / shared memory, compiled on the device).

No jax import at module level: ``phase_llm`` must let ``LLM()`` be what starts jax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import zlib

from tools.device_check import NOT_ON_IMAGE, ROOT

STEP_MODEL = os.path.join(ROOT, "configs", "models", "llama-3.1-8b.json")


def phase_llm(rec, opts) -> None:
    """The pool-bug class: whatever the engine does at start-up (memory sizing sets allocator
    variables) must leave jax on the accelerator. Default settings; the model is a random-init
    2-layer Llama (the embedded default model is not on the device image)."""
    from jaxserve import LLM, SamplingParams

    assert "jax" not in sys.modules or not _backends_started(), "jax was started before LLM()"
    t0 = time.perf_counter()
    # precompile=False: the buckets compile in the generate phase; this one is about start-up
    llm = LLM(opts.model_dir, precompile=False)
    start_s = time.perf_counter() - t0
    import jax

    from jaxserve.runtime import compat

    backend = jax.default_backend()
    present = compat.probe_accelerators()
    plugins = {kind: dict(zip(("installed", "error"), compat.plugin_state(kind))) for kind in present}
    hint = compat.accelerator_hint(backend, present)
    outs = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    made = len(outs[0].outputs[0].token_ids)
    engine = llm.engine
    on_accelerator = backend != "cpu" or not any(present.values())
    imported = [m for m in NOT_ON_IMAGE if sys.modules.get(m) is not None]
    rec("llm", backend=backend, devices=[str(d) for d in jax.devices()], accelerator_present=present,
        plugins=plugins, accelerator_unused=hint, start_seconds=round(start_s, 2), tokens=made,
        max_model_len=getattr(engine, "max_model_len", None), num_blocks=getattr(engine, "num_blocks", None),
        allocator_env={k: v for k, v in os.environ.items() if k.startswith("XLA_") and "MEM" in k},
        not_on_image_imported=imported, ok=bool(on_accelerator and made == 8 and not imported))


def _backends_started() -> bool:
    from jaxserve.runtime import compat

    return compat.backends_started()


class RandomCheckpoint:
    """A lazy checkpoint (the runner's ``restore(shardings, dtype)`` path) whose weights are drawn
    on the device, leaf by leaf, straight into their sharding: no host copy, no file."""

    def __init__(self, mc):
        from jaxserve.worker.lower import param_shapes

        self._shapes = param_shapes(mc)

    def shapes(self) -> dict:
        return self._shapes

    def restore(self, shardings: dict, dtype) -> dict:
        import jax

        def leaf(path, shape, sharding):
            seed = zlib.crc32(jax.tree_util.keystr(path).encode())
            if len(shape) == 1:  # norms: ones
                return jax.jit(lambda: jax.numpy.ones(shape, dtype), out_shardings=sharding)()
            draw = jax.jit(lambda k: jax.random.normal(k, shape, dtype) * 0.02, out_shardings=sharding)
            return draw(jax.random.key(seed))

        return jax.tree_util.tree_map_with_path(leaf, self._shapes, shardings,
                                                is_leaf=lambda x: isinstance(x, tuple))


def weight_bytes_read(shapes, itemsize: int) -> int:
    """Bytes a decode step reads of the weights: every matrix once, the embedding table never
    (a gather of a few rows)."""
    import jax
    import numpy as np

    total = 0
    for path, shape in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        if "embed" not in jax.tree_util.keystr(path):
            total += int(np.prod(shape)) * itemsize
    return total


def phase_step8b(rec, opts, deadline) -> None:
    """Llama-3.1-8B shapes at ``--step-layers`` layers (2 by default: compiles in seconds; 32 fit
    an H200's memory, 16 GB of weights, but each unrolled bucket compiles for about a minute),
    a decode step at each batch over ``step_ctx`` tokens of context, against
    (weight bytes + KV bytes read) / the copy phase's bandwidth."""
    import jax
    import numpy as np

    from jaxserve.core.batch import RowSpec, Sampling
    from jaxserve.worker import runner as rt
    from jaxserve.worker.lower import load_model_config
    from tools.device_check_phases import copy_gbps, timed

    mc = load_model_config(STEP_MODEL)
    mc = dataclasses.replace(mc, num_layers=opts.step_layers)
    if opts.cpu_smoke:  # the same code at a width the CPU runs in seconds
        mc = dataclasses.replace(mc, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                                 head_dim=64, vocab_size=1024)
    ctx, batches = opts.step_ctx, opts.step_sweep
    pages = -(-(ctx + 1) // 16)
    cfg = rt.RunnerConfig(block_size=16, num_blocks=max(batches) * pages + 1, max_model_len=ctx + 16,
                          max_num_seqs=max(batches), max_num_batched_tokens=max(256, max(batches)),
                          dtype="bfloat16")
    t0 = time.perf_counter()
    ckpt = RandomCheckpoint(mc)
    runner = rt.ModelRunner(mc, ckpt, cfg)
    key = jax.random.key(1)
    runner.kv = rt.KVCaches(jax.tree.map(lambda x: jax.random.normal(key, x.shape, x.dtype), runner.kv.layers),
                            runner.kv.layout)  # never time on zeros
    jax.block_until_ready(runner.kv.layers)
    setup_s = time.perf_counter() - t0
    wbytes = weight_bytes_read(ckpt.shapes(), 2)
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    ceiling = copy_gbps(rec)
    for b in batches:
        if time.time() > deadline:
            rec("step8b", batch=b, skipped="deadline")
            break
        rows = [RowSpec(list(range(ctx + 1)), ctx, 1, [1 + s * pages + i for i in range(pages)], Sampling())
                for s in range(b)]
        batch, bucket, _ = runner.builder.build(rows)
        flat = batch.pack()

        def step(flat=flat, bucket=bucket):
            return runner.execute(flat, bucket).tokens

        sec = timed(step, ())
        nbytes = wbytes + b * ctx * kv_token
        row = dict(layers=mc.num_layers, batch=b, ctx=ctx, bucket=str(bucket), us=round(sec * 1e6, 1),
                   weight_bytes=wbytes, kv_bytes=b * ctx * kv_token, setup_seconds=round(setup_s, 1),
                   attention=runner.backend.describe())
        if ceiling:
            roof = nbytes / (ceiling * 1e9)
            row.update(copy_gbps=ceiling, roofline_us=round(roof * 1e6, 1), achieved=round(roof / sec, 3))
        rec("step8b", **row, ok=bool(np.isfinite(sec)))


def phase_ptxas(rec, opts, deadline) -> None:
    """The device's own compile of each kernel family at the 8B head shape (decode and mixed
    batches), read back through the deviceless tier's parser (runtime/deviceless.py): registers,
    spills, stack and shared memory per Mosaic GPU kernel. MOSAIC_GPU_DUMP_PTXAS=1 is set by the
    parent. Kernels in the CPU interpreter or on TPU have no ptxas: an empty list, said so."""
    import jax

    from jaxserve.runtime import deviceless
    from tools.device_check_phases import SHAPE_8B, device_batch, kernels

    d = SHAPE_8B[2]
    cases = {"decode": ([1] * 64, [2048] * 64), "mixed": ([512, 1, 1], [512, 2048, 900])}
    if opts.cpu_smoke:
        cases = {"decode": ([1, 1], [16, 40]), "mixed": ([8, 1], [8, 40])}
    for name, fn in kernels(opts).items():
        for case, (q_lens, kv_lens) in cases.items():
            if name == "split_kv" and case != "decode":
                continue
            if time.time() > deadline:
                return rec("ptxas", kernel=name, skipped="deadline")
            args = device_batch(7, q_lens, kv_lens, SHAPE_8B, jax.numpy.bfloat16)
            report = deviceless.compile_report(
                lambda: jax.jit(functools.partial(fn, sm_scale=d ** -0.5)).lower(*args))
            row = report.as_dict()
            row["spill_bytes"] = sum(k.spills for k in report.kernels)
            if not row["kernels"]:
                row["note"] = ("no ptxas output: " + ("the kernel ran in its interpreter" if opts.cpu_smoke
                               else f"{jax.default_backend()} compile (ptxas runs for Mosaic GPU only)"))
            rec("ptxas", kernel=name, batch=case, **json.loads(json.dumps(row, default=str)))
