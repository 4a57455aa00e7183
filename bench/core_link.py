"""How far apart this machine's first two CPUs are now: a cache line's round trip between them.

A cloud VM's vCPUs are placed by the hypervisor, and the placement changes while a VM runs. On the
2-core AMD EPYC VMs this project benchmarks on, a line bounced between CPU 0 and CPU 1 takes ~50 ns in
some minutes (one core complex, a shared L3) and ~340-400 ns in others (further apart). In the slow
placement a 6,400-token prefill burst takes ~30% longer (3.8 s against 4.9 s, the same work and
user CPU time, the same register-only bf16 peak), because every kernel's output the other thread
reads crosses that link. So a speed figure is comparable only with one measured in the same
placement: `round_trip_ns()` before and after a measured run says which one it was.

The probe is a few lines of C++ (two threads pinned to CPUs 0 and 1 hand a counter back and forth),
built once with the compiler the CPU kernels use and kept under the cache directory. It runs ~20 ms,
outside any measured run.

    jaxserve bench core_link [N]      # prints the round trip now, N times (5) a second apart
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from jaxserve.paths import cache_dir

SOURCE = r"""
#include <atomic>
#include <chrono>
#include <cstdio>
#include <pthread.h>
#include <sched.h>
#include <thread>

alignas(64) static std::atomic<long> turn{0};

static void Pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Player `first` (0 or 1) waits for turn's parity to be its own, then passes it on.
static void Play(int cpu, long first, long rounds) {
  Pin(cpu);
  for (long i = first; i < 2 * rounds; i += 2) {
    while (turn.load(std::memory_order_acquire) != i) {
    }
    turn.store(i + 1, std::memory_order_release);
  }
}

int main() {
  const long rounds = 100000;
  std::thread other(Play, 1, 1, rounds);
  const auto t0 = std::chrono::steady_clock::now();
  Play(0, 0, rounds);
  other.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%.1f\n", s / rounds * 1e9);
}
"""


def _probe() -> Path | None:
    """The built probe, built on first use; None without a C++ compiler."""
    from jaxserve.runtime.native_build import compiler

    cxx = compiler()
    if cxx is None:
        return None
    key = hashlib.sha256((cxx + SOURCE).encode()).hexdigest()[:16]
    exe = cache_dir() / "bench" / f"core_link-{key}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        src = exe.with_suffix(".cc")
        src.write_text(SOURCE)
        tmp = exe.with_name(exe.name + f".{os.getpid()}")
        subprocess.run([cxx, "-O2", "-pthread", str(src), "-o", str(tmp)], check=True, capture_output=True)
        os.replace(tmp, exe)
    return exe


def round_trip_ns() -> float | None:
    """A cache line's round trip between CPUs 0 and 1 now, in ns; None on one CPU or no compiler."""
    if not {0, 1} <= os.sched_getaffinity(0):
        return None
    exe = _probe()
    if exe is None:
        return None
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60)
    return round(float(out.stdout.split()[0]), 1)


def placement(ns: float | None, near_ns: float = 150.0) -> str:
    """'near' (one core complex), 'far', or '?' (not measured)."""
    return "?" if ns is None else "near" if ns < near_ns else "far"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for i in range(int(argv[0]) if argv else 5):
        if i:
            time.sleep(1)
        ns = round_trip_ns()
        print(f"{ns} ns ({placement(ns)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
