"""`jaxserve bench health_load`: /health latency while N streaming clients arrive at once.

Issue 18: 256 streams, max_tokens 32, /health under 100 ms throughout.

N streaming /v1/completions requests (official `openai` client, max_tokens 32, ignore_eos) are sent
at the same moment; a prober in its own process (so the clients' event loop cannot delay it) GETs
/health every --probe-interval seconds on one keep-alive connection before, during and after them.
The probes are split into phases: `idle` (before the burst), `arrival` (until every stream has
its first token), `streaming` (until the last stream ends). Afterwards it checks what a test
checks: every stream well formed (one finish_reason, "length", at the end), 0 failures, and the
engine idle with every KV block free (/metrics).

    jaxserve bench health_load --launch [--num-streams 256] [--out bench/out/health_load.json]
    jaxserve bench health_load --base-url http://127.0.0.1:8000
    jaxserve bench health_load --launch --stall-cases   # issue 31: one hostile request at a time
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import re
import time
from dataclasses import asdict, dataclass, field

from bench import common
from bench.launch import launched_server

SLOW_MS = 100.0  # issue 18's bound for one /health answer


@dataclass
class Stream:
    ok: bool = False
    start: float = 0.0
    first: float = 0.0  # time.time() of the first chunk with text
    end: float = 0.0
    chunks: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None


def probe(url: str, interval: float, ready, stop, out) -> None:
    """The prober process: (time.time(), latency s, status) per /health, until `stop` is set."""
    import httpx

    rows = []
    with httpx.Client(base_url=url, timeout=30) as h:
        h.get("/health")  # connected: the idle phase can begin
        ready.set()
        while not stop.is_set():
            t0 = time.time()
            try:
                status = h.get("/health").status_code
            except httpx.HTTPError:
                status = 0
            rows.append((t0, time.time() - t0, status))
            time.sleep(max(0.0, interval - (time.time() - t0)))
    out.send(rows)


async def one_stream(client, model: str, i: int, max_tokens: int) -> Stream:
    s = Stream(start=time.time())
    try:
        stream = await client.completions.create(
            model=model,
            prompt=f"Client {i} says",
            max_tokens=max_tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            s.chunks += 1
            c = chunk.choices[0]
            if c.text and not s.first:
                s.first = time.time()
            if c.finish_reason:
                s.finish_reasons.append(c.finish_reason)
        s.ok = s.finish_reasons == ["length"]
        if not s.ok:
            s.error = f"finish reasons {s.finish_reasons}"
    except Exception as e:  # noqa: BLE001 - counted as a failure
        s.error = f"{type(e).__name__}: {e}"[:300]
    s.end = time.time()
    return s


async def burst(url: str, num: int, max_tokens: int) -> tuple[str, list[Stream]]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="none", http_client=http, max_retries=0
        )
        model = (await client.models.list()).data[0].id
        return model, await asyncio.gather(
            *[one_stream(client, model, i, max_tokens) for i in range(num)]
        )


def gauge(metrics: str, name: str) -> float:
    return sum(
        float(m[1])
        for m in re.finditer(rf"^jaxserve:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
    )


def phases(rows, streams: list[Stream], t0: float) -> dict[str, list[tuple]]:
    arrived = max((s.first or s.end) for s in streams)
    ended = max(s.end for s in streams)
    out: dict[str, list[tuple]] = {"idle": [], "arrival": [], "streaming": [], "after": []}
    for r in rows:
        key = (
            "idle"
            if r[0] < t0
            else "arrival"
            if r[0] < arrived
            else "streaming"
            if r[0] < ended
            else "after"
        )
        out[key].append(r)
    return out


def run(url: str, args) -> dict:
    import httpx

    ctx = mp.get_context("spawn")
    ready, stop, (recv, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(
        target=probe, args=(url, args.probe_interval, ready, stop, send), daemon=True
    )
    prober.start()
    if not ready.wait(120):
        raise RuntimeError(f"the /health prober could not reach {url}")
    time.sleep(args.idle_seconds)
    t0 = time.time()
    model, streams = asyncio.run(burst(url, args.num_streams, args.max_tokens))
    t_end = time.time()
    time.sleep(args.idle_seconds)
    stop.set()
    rows = recv.recv()
    prober.join(30)
    m = httpx.get(url + "/metrics", timeout=30).text
    engine = {
        "running": gauge(m, "num_requests_running"),
        "waiting": gauge(m, "num_requests_waiting"),
        "kv_cache_usage_perc": gauge(m, "kv_cache_usage_perc"),
    }
    by_phase = {}
    for name, rs in phases(rows, streams, t0).items():
        ms = [r[1] * 1e3 for r in rs]
        by_phase[name] = {
            **common.summarize(ms),
            "over_100ms": sum(v >= SLOW_MS for v in ms),
            "non_200": sum(r[2] != 200 for r in rs),
        }
    ttft = [(s.first - s.start) * 1e3 for s in streams if s.first]
    failures = [s.error for s in streams if not s.ok]
    return {
        "model": model,
        "wall_s": t_end - t0,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "ttft_ms": common.summarize(ttft),
        "health_ms": by_phase,
        "engine_after": engine,
        "worst_probes": sorted(
            ([round(r[0] - t0, 3), round(r[1] * 1e3, 1), r[2]] for r in rows), key=lambda r: -r[1]
        )[:10],
        "streams": [asdict(s) for s in streams] if args.keep_streams else None,
    }


def run_stall_cases(url: str, args) -> dict:
    """Issue 31: each stall case alone (bench/stall_cases.py) with /health probed meanwhile."""
    import httpx

    from bench.stall_cases import cases

    ctx = mp.get_context("spawn")
    ready, stop, (recv, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe, args=(url, args.probe_interval, ready, stop, send), daemon=True)
    prober.start()
    if not ready.wait(120):
        raise RuntimeError(f"the /health prober could not reach {url}")
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    windows = []
    with httpx.Client(base_url=url, timeout=600) as h:
        for name, path, body in cases(model.get("max_model_len") or 2048):
            t0 = time.time()
            try:
                status = h.post(path, content=body, headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError as e:
                status = f"{type(e).__name__}"
            windows.append((name, status, t0, time.time()))
            time.sleep(args.idle_seconds)
    stop.set()
    rows = recv.recv()
    prober.join(30)
    out = []
    for name, status, t0, t1 in windows:
        ms = [r[1] * 1e3 for r in rows if t0 <= r[0] <= t1 + 0.1]
        out.append({"case": name, "status": status, "wall_s": round(t1 - t0, 3), "probes": len(ms),
                    "health_max_ms": round(max(ms), 1) if ms else None,
                    "over_100ms": sum(v >= SLOW_MS for v in ms),
                    "non_200": sum(r[2] != 200 for r in rows if t0 <= r[0] <= t1)})
    return {"model": model["id"], "cases": out,
            "failures": sum(c["over_100ms"] > 0 or c["non_200"] > 0 or not (isinstance(c["status"], int)
                                                                           and c["status"] < 500) for c in out)}


def print_stall_results(res: dict) -> None:
    rows = [[c["case"], c["status"], f"{c['wall_s']:.2f}", c["probes"], common.fmt(c["health_max_ms"]),
             c["over_100ms"], c["non_200"]] for c in res["cases"]]
    print(common.table(rows, ["case", "status", "wall s", "probes", "/health max ms", ">=100 ms", "non-200"],
                       title="/health during each stall case (issue 31)"))


def print_results(res: dict) -> None:
    rows = [
        [
            name,
            s["n"],
            common.fmt(s["median"]),
            common.fmt(s["p90"]),
            common.fmt(s["p99"]),
            common.fmt(s["max"]),
            s["over_100ms"],
            s["non_200"],
        ]
        for name, s in res["health_ms"].items()
    ]
    print(
        common.table(
            rows,
            ["phase", "probes", "median ms", "p90", "p99", "max", ">=100 ms", "non-200"],
            title="/health latency",
        )
    )
    e = res["engine_after"]
    print(
        f"streams: {res['failures']} failed; wall {res['wall_s']:.1f} s; TTFT median "
        f"{common.fmt(res['ttft_ms']['median'])} ms, max {common.fmt(res['ttft_ms']['max'])} ms; "
        f"after: running {e['running']:g}, waiting {e['waiting']:g}, KV in use "
        f"{e['kv_cache_usage_perc']:g}"
    )
    print("worst probes (s after the burst began, ms, status):", res["worst_probes"][:5])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxserve bench health_load",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--base-url", default=None, help="a running server (default: --launch one)")
    p.add_argument("--launch", action="store_true", help="start `jaxserve serve` (the default)")
    p.add_argument(
        "--model", "-m", default=None, help="--launch's model (default: the default model)"
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `jaxserve serve` arguments for --launch (default: %(default)s)",
    )
    p.add_argument("--server-log", default=None)
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--num-streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--probe-interval", type=float, default=0.02, help="seconds between /health GETs"
    )
    p.add_argument(
        "--idle-seconds", type=float, default=1.0, help="probing before and after the burst"
    )
    p.add_argument(
        "--keep-streams", action="store_true", help="write every stream's timings to --out"
    )
    p.add_argument("--stall-cases", action="store_true",
                   help="send issue 31's stall cases one at a time instead of the stream burst")
    p.add_argument("--out", default=None, help="write the JSON document here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    go = run_stall_cases if args.stall_cases else run
    if args.base_url:
        res = go(args.base_url.rstrip("/"), args)
        server = {"base_url": args.base_url}
    else:
        with launched_server(args) as (url, server):
            res = go(url, args)
    (print_stall_results if args.stall_cases else print_results)(res)
    common.report(
        "health_load",
        argv,
        model={"served": res["model"]},
        config={**vars(args), "server": server},
        results=res,
        out=args.out,
        jax_devices=False,
    )
    return 0 if res["failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
