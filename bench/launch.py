"""A `jaxserve serve` for a benchmark to drive: a free 127.0.0.1 port, the server started on it with
the benchmark's arguments, healthy before the load starts, stopped after (bench/serve.py,
bench/health_load.py, bench/vllm_compare.py, bench/replicas.py)."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from bench import common


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(args):
    """`jaxserve serve` on a free 127.0.0.1 port; yields its base URL; stops it (SIGTERM, then kill)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.server_args or "")
    log_path = args.server_log or os.path.join(tempfile.gettempdir(), f"jaxserve-bench-serve-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    print(f"launching: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def tail() -> str:
            log.flush()
            with open(log_path) as f:
                return f.read()[-2000:]

        common.wait_healthy(proc, url, args.launch_timeout, tail)
        print(f"server healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        yield url, {"command": shlex.join(cmd), "ready_s": time.perf_counter() - t0, "log": log_path}
    finally:
        common.stop_server(proc)
        log.close()
