"""`jaxserve lower --compile`: every bucket's step through the target's real compiler, on this host.

The lowering is `worker/lower.py`'s (the engine's own step, weights as shapes), laid out on a
compile-only topology's devices (`runtime/deviceless.py`) instead of an abstract mesh, so
`.compile()` runs XLA:GPU with Mosaic GPU and ptxas for a named GPU, or Mosaic TPU and XLA:TPU for a
TPU generation. One line per bucket: ok or the compiler's error, compile seconds, the executable's
temporaries next to the estimate, and each Mosaic GPU kernel's registers, spills and shared memory.
The memory plan is printed again with the largest compiled temporaries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.errors import UserError
from jaxserve.runtime import deviceless, memory

DEFAULT_TARGET = {"cuda": "h100", "tpu": "v5e"}


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def describe_kernels(kernels: list[deviceless.KernelReport]) -> str:
    return "; ".join(
        f"{k.name}: {k.registers} registers, {k.spills} B spills, "
        f"{'?' if k.smem_bytes is None else f'{k.smem_bytes / 1024:.1f} KiB'} shared memory" for k in kernels)


def bucket_line(key: BucketKey, target: str, report: deviceless.CompileReport, estimate: int) -> str:
    kind = (f" C={key.c}" if key.c else "") + (" decode" if key.decode else "")
    head = f"compiled T={key.t} S={key.s} W={key.w}{kind} for {target}: "
    if not report.ok:
        return head + f"ERROR after {report.seconds:.1f} s: {report.error}"
    line = (head + f"ok {report.seconds:.1f} s ({report.cpu_seconds:.1f} s CPU), temporaries {_mib(report.temp_bytes)} "
            f"(estimated {_mib(estimate)})")
    if report.kernels:
        line += f"; {describe_kernels(report.kernels)}"
    elif report.cached_kernels:
        line += "; its kernels were compiled for an earlier bucket (Mosaic's cache): same figures"
    return line


def pick_buckets(keys: list[BucketKey], which: str) -> list[BucketKey]:
    """``all``, or ``largest``: the largest mixed bucket and the largest decode bucket."""
    keys = sorted(keys)
    if which == "all":
        return keys
    mixed = [k for k in keys if not k.decode]
    decode = [k for k in keys if k.decode]
    return [max(group, key=lambda k: (k.t, k.s, k.w, k.c)) for group in (mixed, decode) if group]


def run(args, config: EngineConfig, out: Callable[[str], None] = print) -> int:
    from jaxserve.worker import lower

    platform = args.platform
    why = deviceless.missing(platform)
    if why:
        raise UserError(why, param="compile")
    deviceless.prepare_env((platform,))
    target = deviceless.target(platform, args.target or DEFAULT_TARGET[platform])
    devices = target.devices(config.tensor_parallel_size)
    lowering = lower.prepare(
        args.model, platform, config, device_memory=args.device_memory or target.memory_bytes,
        compute_capability=target.compute_capability or args.compute_capability, devices=devices,
        num_layers=getattr(args, "num_layers", None))
    for line in lowering.describe():
        out(line)
    out(f"compiling for {target.name} ({devices[0].device_kind}"
        + (f", sm_{target.compute_capability.replace('.', '')}" if target.compute_capability else "")
        + f") on {len(devices)} compile-only device(s), {lowering.model.num_layers} layers")
    keys = pick_buckets(lowering.runner.all_buckets(), getattr(args, "buckets", "all"))
    rows, t0 = [], time.perf_counter()
    for key in keys:
        report = lowering.compile(key)
        estimate = lowering.estimate(key)
        out(bucket_line(key, target.name, report, estimate))
        rows.append({"t": key.t, "s": key.s, "w": key.w, "c": key.c, "decode": key.decode,
                     "estimated_temp_bytes": estimate, **report.as_dict()})
    failed = [r for r in rows if not r["ok"]]
    out(f"compiled {len(rows)} buckets for {target.name}: {len(rows) - len(failed)} ok, {len(failed)} failed, "
        f"{time.perf_counter() - t0:.1f} s")
    temps = [(r["temp_bytes"], r) for r in rows if r["ok"] and r["temp_bytes"] is not None]
    if temps:
        temp, row = max(temps, key=lambda x: x[0])
        out(f"temporaries: compiled {_mib(temp)} (largest, T={row['t']} S={row['s']}) vs estimated "
            f"{_mib(lowering.plan.activation_bytes)}; the plan with the compiled figure:")
        out(memory.summary(lowering.replan(temp)))
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps({"target": target.name, "platform": platform,
                                               "model": args.model, "buckets": rows}, indent=1))
    return 1 if failed else 0
