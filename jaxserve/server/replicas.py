"""`jaxserve serve --data-parallel-size N`: N replicas in one command, SMG in front.

Data parallelism here is N independent `jaxserve serve` processes, each with its own port, its own
device set (CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS slices of `tensor_parallel_size` chips; on CPU
its own cores, by affinity, which XLA sizes its thread pool by), its own health, and its own KV-event
endpoints (vLLM's rule: ports + rank). Routing is SMG's job (`pip install 'jaxserve[router]'`):
started on `--port` with every replica as a worker when installed; otherwise the exact command is
printed. The supervisor restarts a replica that exits (up to `--replica-max-restarts` times) and
says so; one that keeps dying is reported dead, never dropped silently, and the rest keep serving.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from jaxserve.errors import UserError
from jaxserve.server.kv_events import offset_endpoint

log = logging.getLogger("jaxserve.replicas")
POLICIES = ("cache_aware", "round_robin", "least_load", "power_of_two", "random", "prefix_hash")
OWN_FLAGS = {"--data-parallel-size": 1, "--router": 1, "--router-policy": 1, "--replica-max-restarts": 1,
             "--port": 1, "--kv-events-config": 1, "--profiler-dir": 1}


def add_replica_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="serve N replicas (N processes on disjoint devices; ports --port+1..--port+N) "
                   "behind SMG on --port (default %(default)s: one server on --port)")
    g.add_argument("--router", choices=("auto", "smg", "none"), default="auto",
                   help="start SMG in front of the replicas (auto: when installed and N > 1; smg/none "
                   "also launch a single replica behind the router or its printed command)")
    g.add_argument("--router-policy", choices=POLICIES, default="cache_aware",
                   help="SMG's routing policy (default %(default)s: longest prefix match, then load)")
    g.add_argument("--replica-max-restarts", type=int, default=3,
                   help="restart a replica that exits up to this many times, then report it dead")


def replica_argv(argv: list[str]) -> list[str]:
    """The `serve` arguments every replica shares: ours removed (each gets its own port/endpoints)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in OWN_FLAGS:
            skip = 0 if "=" in a else OWN_FLAGS[name]
            continue
        out.append(a)
    return out


def rank_flags(args: argparse.Namespace, rank: int) -> list[str]:
    """The `serve` flags replica `rank` gets on its own: its port, its KV-event endpoints (vLLM's rule
    for DP ranks: the ports + rank) and its profile directory (jax names a trace by host and second)."""
    out = ["--port", str(args.port + 1 + rank)]
    if args.kv_events_config:
        kv_cfg = json.loads(args.kv_events_config)
        mine = {**kv_cfg, "endpoint": offset_endpoint(kv_cfg.get("endpoint", "tcp://*:5557"), rank),
                "replay_endpoint": offset_endpoint(kv_cfg.get("replay_endpoint"), rank)}
        out += ["--kv-events-config", json.dumps(mine)]
    if args.profiler_dir:
        out += ["--profiler-dir", os.path.join(args.profiler_dir, f"replica{rank}")]
    return out


def device_env(rank: int, n: int, tp: int, env: dict[str, str]) -> tuple[dict[str, str], set[int] | None]:
    """Environment and CPU affinity of replica `rank`: a disjoint slice of the visible accelerators,
    or on CPU a share of the cores (round robin when replicas outnumber cores)."""
    env = dict(env)
    gpus = env.get("CUDA_VISIBLE_DEVICES")
    if gpus is None and shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = ",".join(str(i) for i in range(sum(1 for line in listed.splitlines() if line.startswith("GPU"))))
    if gpus:
        ids = gpus.split(",")
        if len(ids) < n * tp:
            raise UserError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs; "
                            f"{len(ids)} are visible.", param="data_parallel_size")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[rank * tp:(rank + 1) * tp])
        return env, None
    if os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):  # TPU VM
        env["TPU_VISIBLE_CHIPS"] = ",".join(str(i) for i in range(rank * tp, (rank + 1) * tp))
        env["TPU_PROCESS_BOUNDS"] = "1,1,1"
        env["TPU_PROCESS_PORT"] = str(8476 + rank)
        return env, None
    cores = sorted(os.sched_getaffinity(0))  # XLA:CPU sizes its thread pool by the affinity mask
    share = max(1, len(cores) // n)
    return env, {cores[(rank * share + k) % len(cores)] for k in range(share)}


def smg_command(port: int, host: str, urls: list[str], policy: str, api_key: str | None) -> list[str]:
    cmd = ["smg", "launch", "--host", host, "--port", str(port), "--worker-urls", *urls, "--policy", policy,
           "--prometheus-port", str(port + len(urls) + 1), "--health-check-interval-secs", "2",
           "--health-failure-threshold", "2", "--health-success-threshold", "1"]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


@dataclass
class Replica:
    rank: int
    port: int
    cmd: list[str]
    env: dict[str, str]
    cpus: set[int] | None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    healthy: bool = False
    started_once: bool = False  # was healthy at least once (a failure before that is a start-up error)
    dead: bool = False
    log_tail: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cpus = self.cpus
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self.healthy = False

    def probe(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):  # refused, reset, or not HTTP at all
            return False


def run_replicas(args: argparse.Namespace, argv: list[str]) -> int:
    n, tp = args.data_parallel_size, getattr(args, "tensor_parallel_size", 1) or 1
    if n < 1:
        raise UserError(f"Invalid --data-parallel-size {n}: must be >= 1.", param="data_parallel_size")
    if args.port + n >= 65536:
        raise UserError(f"--port {args.port} leaves no room for {n} replica ports above it.", param="port")
    for p in range(args.port + 1, args.port + 1 + n):
        with socket.socket() as s:
            try:
                s.bind((args.host, p))
            except OSError:
                raise UserError(f"Replica port {p} (--port {args.port} + rank + 1) is in use: choose another "
                                "--port.", param="port") from None
    base = [sys.executable, "-m", "jaxserve.cli", *replica_argv(argv)]
    replicas = []
    for rank in range(n):
        cmd = [*base, *rank_flags(args, rank)]
        env, cpus = device_env(rank, n, tp, os.environ)
        replicas.append(Replica(rank, args.port + 1 + rank, cmd, env, cpus))
    urls = [r.url for r in replicas]
    router_cmd = smg_command(args.port, args.host, urls, args.router_policy, args.api_key)
    use_smg = args.router == "smg" or (args.router == "auto" and shutil.which("smg"))
    if args.router == "smg" and not shutil.which("smg"):
        raise UserError("--router smg: smg is not installed; pip install 'jaxserve[router]'.", param="router")
    stopping = False

    def stop(sig, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for r in replicas:
        log.info("replica %d: %s (cpus %s)", r.rank, r.url, sorted(r.cpus) if r.cpus else "-")
        r.start()
    router = None
    try:
        while not stopping and not all(r.healthy or r.dead for r in replicas):
            supervise(replicas, args.replica_max_restarts)
            time.sleep(0.5)
        if stopping:
            return 0
        if use_smg:
            log.info("router: %s", " ".join(router_cmd))
            router = subprocess.Popen(router_cmd, start_new_session=True)
        else:
            print("jaxserve: replicas ready; route them with SMG (pip install 'jaxserve[router]'):\n  "
                  + " ".join(router_cmd), flush=True)
        while not stopping:
            supervise(replicas, args.replica_max_restarts)
            if router is not None and router.poll() is not None:
                log.error("router exited with code %s; restarting it", router.returncode)
                router = subprocess.Popen(router_cmd, start_new_session=True)
            time.sleep(1.0)
        return 0
    finally:
        for p in [router] + [r.proc for r in replicas]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [router] + [r.proc for r in replicas]:
            if p is not None:
                try:
                    p.wait(timeout=args.shutdown_timeout + 10)
                except subprocess.TimeoutExpired:
                    p.kill()


def supervise(replicas: list[Replica], max_restarts: int) -> None:
    """One pass: restart exited replicas (or report them dead), log health changes."""
    for r in replicas:
        if r.dead:
            continue
        code = r.proc.poll()
        if code is not None:
            if code == 2 and not r.started_once:  # a UserError (bad flag, missing model): fatal for all
                raise UserError(f"replica {r.rank} could not start (exit code 2, its error is above).")
            if r.restarts >= max_restarts:
                r.dead = True
                log.error("replica %d (%s) exited with code %s and was restarted %d times: reported "
                          "dead; the other replicas keep serving", r.rank, r.url, code, r.restarts)
                continue
            r.restarts += 1
            log.warning("replica %d (%s) exited with code %s: restarting (%d/%d)", r.rank, r.url, code,
                        r.restarts, max_restarts)
            r.start()
            continue
        ok = r.probe()
        if ok != r.healthy:
            log.info("replica %d (%s) is %s", r.rank, r.url, "healthy" if ok else "unhealthy")
            r.healthy = ok
            r.started_once |= ok
    if all(r.dead for r in replicas):
        raise UserError("every replica died; see their errors above.")
