"""`jaxserve bench memory`: where the engine's resident memory (RSS) goes, phase by phase.

One process builds the engine the way `jaxserve serve` does, step by step, and reads its RSS
(/proc/self/status, anonymous and file-backed parts from /proc/self/smaps_rollup) after each:

  python       the interpreter alone
  imports      jaxserve, jax, numpy, the server's modules (Starlette, uvicorn, pydantic)
  jax backend  XLA:CPU client started
  native code  the csrc/ kernels built (or found in the cache) and loaded
  tokenizer    the model's tokenizer
  engine       weights loaded and placed, the KV cache allocated (zeroed, so resident)
  compile      every step bucket compiled (executables, XLA's compile-time arenas), or loaded from the
               step cache (worker/step_cache.py) on a warm cache
  heap trimmed glibc's malloc_trim(0): freed heap the allocator still held, handed back to the OS
  first token  one request served

Next to the deltas it prints what was accounted for directly: the parameters' bytes, the KV
cache's bytes, the native library's size, the executables' generated code and constants (XLA's
memory analysis, summed over buckets) and the step cache's files. The machine may be loaded; RSS
does not depend on it. Run it twice on one JAXSERVE_CACHE_DIR for the cold and the warm figures.

    jaxserve bench memory [--model PATH] [--engine-args '{"max_num_seqs": 64}'] [--no-precompile] [--out f.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

from bench import common


def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) * 1024
    return {"rss": out.get("VmRSS", 0), "anon": out.get("RssAnon", 0), "file": out.get("RssFile", 0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", "-m", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--engine-args", default="", help='EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64}\'')
    p.add_argument("--no-precompile", dest="precompile", action="store_false")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    kw = json.loads(args.engine_args) if args.engine_args else {}

    phases = [("python", _rss(), 0.0)]
    t0 = time.perf_counter()

    def mark(name: str) -> None:
        phases.append((name, _rss(), time.perf_counter() - t0))

    import jax
    import numpy  # noqa: F401

    import jaxserve.server.app  # noqa: F401  (what `serve` imports)
    from jaxserve import LLM, SamplingParams
    mark("imports")
    jax.devices()
    mark("jax backend")
    from jaxserve.runtime import cpu_kernels

    native_error = cpu_kernels.available()
    mark("native code")
    from jaxserve.model.loader import resolve_model_path
    from jaxserve.tokenizer import Tokenizer

    Tokenizer.from_pretrained(resolve_model_path(args.model))
    mark("tokenizer")
    llm = LLM(args.model, precompile=False, **kw)
    mark("engine")
    if args.precompile:
        llm.engine.precompile()
        mark("compile")
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mark("heap trimmed")
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    mark("first token")

    from jaxserve.runtime import quant_params

    runner = llm.engine.runner
    weights = quant_params.weight_bytes(runner.params)
    kv = sum(int(x.nbytes) for layer in runner.kv_caches for x in jax.tree_util.tree_leaves(layer))
    lib = cpu_kernels._state.get("lib")
    lib_bytes = os.path.getsize(lib._name) if lib is not None else 0
    code = {"generated code": 0, "constants": 0, "peak temp (not resident)": 0}
    for exe in runner.executables():
        a = exe.memory_analysis()
        a = a[0] if isinstance(a, (list, tuple)) else a
        code["generated code"] += getattr(a, "generated_code_size_in_bytes", 0) or 0
        code["constants"] += getattr(a, "constant_size_in_bytes", 0) or 0
        code["peak temp (not resident)"] += getattr(a, "temp_size_in_bytes", 0) or 0
    from jaxserve.worker import step_cache

    steps = step_cache.directory()
    step_files = sum(f.stat().st_size for f in steps.glob("*.bin")) if steps and steps.is_dir() else 0
    rows, prev = [], 0
    for name, r, t in phases:
        rows.append((name, r["rss"] / 2**20, (r["rss"] - prev) / 2**20, r["anon"] / 2**20, r["file"] / 2**20, t))
        prev = r["rss"]
    print(common.table(rows, ("phase", "RSS MiB", "delta MiB", "anon MiB", "file MiB", "at s"),
                       "Resident memory by start-up phase (one process, as `jaxserve serve` builds it)"))
    accounted = [("parameters (as held by the runner)", weights / 2**20), ("KV cache arrays", kv / 2**20),
                 ("native library file", lib_bytes / 2**20),
                 *((f"executables: {k} ({runner.num_compiles} buckets)", v / 2**20) for k, v in code.items()),
                 ("step cache files (serialized executables)", step_files / 2**20)]
    print(common.table(accounted, ("accounted directly", "MiB")))
    print(f"  backend: {runner.backend.describe()}" + (f" (native: {native_error})" if native_error else ""))
    common.report("memory", argv, model={"model": args.model or "default"}, config=vars(args),
                  results={"phases": [{"phase": n, **r, "t_s": t} for n, r, t in phases],
                           "weight_bytes": weights, "kv_bytes": kv, "native_library_bytes": lib_bytes,
                           "executables": code, "buckets": runner.num_compiles, "step_cache_bytes": step_files},
                  out=args.out, jax_devices=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
