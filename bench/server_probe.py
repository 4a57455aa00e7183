"""`python -m bench.server_probe`: `jaxserve serve` that records what stalls its event loop.

Runs the server in this process with two recorders: every garbage collection (generation, wall
and CPU time of the thread it ran on: CPU time is what the collection itself cost, wall time
includes the machine's other load) and the event loop's lag (a 5 ms sleep's overshoot). On exit
(SIGTERM) it prints the collections and the worst lags (with how long the loop's and the
engine's threads waited for a CPU meanwhile) and writes them as JSON. `--no-gc-freeze`
serves without freezing the start-up heap (app.freeze_startup_heap), for the before/after.

    python -m bench.server_probe --out bench/out/probe.json [--no-gc-freeze] -- serve --port 8000 &
    jaxserve bench health_load --base-url http://127.0.0.1:8000
    kill -TERM %1
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import threading
import time

from bench import common


class Recorder:
    def __init__(self):
        self.gcs: list[tuple] = []  # (time.time(), generation, wall s, cpu s, thread name)
        self.lags: list[tuple] = []  # (time.time(), lag s, CPU wait s)
        self._start: dict[int, tuple[float, float]] = {}

    def on_gc(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._start[tid] = (time.perf_counter(), time.thread_time())
        elif tid in self._start:
            wall, cpu = self._start.pop(tid)
            self.gcs.append(
                (
                    time.time(),
                    info["generation"],
                    time.perf_counter() - wall,
                    time.thread_time() - cpu,
                    threading.current_thread().name,
                )
            )

    async def watch_loop(self) -> None:
        """Every 5 ms: how late the loop woke up, and how long the loop's thread and the engine's
        (the two that hold the GIL) were runnable but waiting for a CPU meanwhile (Linux
        schedstat: the machine's other load, not this process's work)."""
        ids = [threading.get_native_id()]

        def waited() -> float:
            if len(ids) == 1:  # the engine thread starts with the app's lifespan
                engine = [t for t in threading.enumerate() if t.name == "jaxserve-engine"]
                ids.extend(t.native_id for t in engine)
            total = 0.0
            for tid in ids:
                try:
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[1]) / 1e9
                except (OSError, IndexError, ValueError):
                    pass
            return total

        while True:
            t, w = time.perf_counter(), waited()
            await asyncio.sleep(0.005)
            self.lags.append((time.time(), time.perf_counter() - t - 0.005, waited() - w))

    def summary(self, since: float) -> dict:
        gens = {}
        for g in range(3):
            rows = [r for r in self.gcs if r[1] == g and r[0] >= since]
            gens[f"gen{g}"] = {
                "n": len(rows),
                "max_wall_ms": max((r[2] for r in rows), default=0) * 1e3,
                "max_cpu_ms": max((r[3] for r in rows), default=0) * 1e3,
                "sum_cpu_ms": sum(r[3] for r in rows) * 1e3,
            }
        lags = [r for r in self.lags if r[0] >= since]
        worst = sorted(lags, key=lambda r: -r[1])[:10]
        slow = [r for r in lags if r[1] >= 0.05]
        # how much of the >= 50 ms lags the two GIL threads spent waiting for a CPU
        slow_cpu_wait = sum(min(r[2], r[1]) for r in slow) / max(sum(r[1] for r in slow), 1e-9)
        return {
            "gc": gens,
            "worst_loop_lag_ms": [
                [round(t, 3), round(lag * 1e3, 1), round(cpu_wait * 1e3, 1)]
                for t, lag, cpu_wait in worst
            ],
            "lags_over_50ms": len(slow),
            "their_cpu_wait_share": slow_cpu_wait if slow else None,
            "tracked_objects_at_exit": len(gc.get_objects()),
            "frozen": gc.get_freeze_count(),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.server_probe",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--out", default=None, help="write the JSON document here")
    p.add_argument("--no-gc-freeze", action="store_true", help="do not freeze the start-up heap")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- serve [jaxserve serve flags]")
    args = p.parse_args(argv)
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    import uvicorn

    from jaxserve import cli
    from jaxserve.server import app

    rec, ready = Recorder(), []
    gc.callbacks.insert(0, rec.on_gc)
    if args.no_gc_freeze:
        app.freeze_startup_heap = lambda: None
    startup = uvicorn.Server.startup

    async def startup_and_watch(self, sockets=None):
        ready.append(time.time())
        asyncio.ensure_future(rec.watch_loop())
        await startup(self, sockets)

    uvicorn.Server.startup = startup_and_watch

    def report() -> None:
        res = rec.summary(ready[0] if ready else 0.0)
        print(
            common.table(
                [
                    [
                        g,
                        s["n"],
                        common.fmt(s["max_wall_ms"]),
                        common.fmt(s["max_cpu_ms"]),
                        common.fmt(s["sum_cpu_ms"]),
                    ]
                    for g, s in res["gc"].items()
                ],
                ["collection", "count", "max wall ms", "max cpu ms", "sum cpu ms"],
                title="garbage collections while serving",
            ),
            flush=True,
        )
        print(
            "worst event-loop lags (time, ms late, ms the loop+engine threads waited for a CPU):",
            res["worst_loop_lag_ms"][:5],
            flush=True,
        )
        if res["lags_over_50ms"]:
            print(f"{res['lags_over_50ms']} lags >= 50 ms, {res['their_cpu_wait_share']:.0%} of "
                  "their time the loop's and engine's threads waited for a CPU", flush=True)
        common.report(
            "server_probe",
            argv,
            model={},
            config={**vars(args), "ready": ready},
            results={**res, "gcs": rec.gcs, "lags": rec.lags},
            out=args.out,
            jax_devices=False,
        )

    atexit.register(report)
    return cli.main(serve_args)


if __name__ == "__main__":
    raise SystemExit(main())
