"""Compile every TPU kernel for real TPU chips on this host (libtpu, nothing executes): the table.

Needs libtpu (``pip install 'jax[tpu]'``, the ``compile-tpu`` extra) and ``JAX_PLATFORMS=cpu``::

    JAX_PLATFORMS=cpu python -m bench.tpu_kernel_compile --chips v5e,v6e --out bench/out/tpu_kernels.json

One row per kernel x model x bucket x KV dtype x tensor parallelism x chip
(``pallas_kernels.tpu_cases``): ok, compile seconds, the kernel's VMEM estimate and the
``vmem_limit_bytes`` it asks for against the chip's VMEM, and its SMEM bytes. Exit status 1 when
any case fails to compile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import machine_info, table, write_json

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default="v5e,v6e", help="comma-separated: v5e, v6e (libtpu topologies)")
    ap.add_argument("--models", default=None, help="comma-separated subset of tpu_cases.MODELS")
    ap.add_argument("--kv", default="bf16,int8,fp8", help="KV dtypes: bf16, int8, fp8")
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--no-long", action="store_true", help="skip the 128k-context decode case")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                    help="print the table of earlier runs' JSON files (no compiling)")
    args = ap.parse_args(argv)
    if args.from_json:
        rows = [r for path in args.from_json for r in json.loads(Path(path).read_text())["results"]]
        return _report(rows)

    from pallas_kernels import tpu_cases

    models = tuple(args.models.split(",")) if args.models else tuple(tpu_cases.MODELS)
    cases = list(tpu_cases.cases(models=models, kv_dtypes=tuple(args.kv.split(",")),
                                 tps=tuple(int(t) for t in args.tp.split(",")),
                                 long_context=not args.no_long))
    rows = []
    for chip in args.chips.split(","):
        for case in cases:
            r = tpu_cases.run(case, f"{chip}:2x2")
            rows.append(r)
            write_json(args.out, {"benchmark": "tpu_kernel_compile", "command": " ".join(sys.argv),
                                  "machine": machine_info(jax_devices=False), "partial": True, "results": rows})
            print(f"{r['chip']} {r['kernel']} {r['model']} {r['bucket']} {r['kv']} tp{r['tp']} "
                  f"{'ok' if r['ok'] else 'FAIL'} {r['seconds']}s {r['error'] or ''}", file=sys.stderr, flush=True)
    write_json(args.out, {"benchmark": "tpu_kernel_compile", "command": " ".join(sys.argv),
                          "machine": machine_info(jax_devices=False), "results": rows})
    return _report(rows)


def _report(rows: list[dict]) -> int:
    headers = ("kernel", "model", "bucket", "kv", "tp", "chip", "ok", "compile s", "CPU s", "VMEM est MiB",
               "VMEM limit MiB", "chip VMEM MiB", "SMEM KiB", "error")
    print(table([(r["kernel"], r["model"],
                  r["bucket"] + (f" ctx {r['max_model_len']}" if r["max_model_len"] > 4096 else ""),
                  r["kv"], r["tp"], r["chip"], "ok" if r["ok"] else "FAIL", r["seconds"], r["cpu_seconds"],
                  round(r["vmem_estimate"] / MiB, 2), r["vmem_limit"] // MiB, r["vmem_capacity"] // MiB,
                  round(r["smem_bytes"] / 1024, 1), r["error"] or "") for r in rows], headers))
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
