"""What this CPU can run: its feature flags as Linux names them, and which instructions each of
csrc/dot_matmul.cc's weight formats takes where they are there (`cpu_kernels.choose_isa` makes the
choice once, when the backend is decided, with what the library was built with and what Linux
grants; `$JAXSERVE_CPU_ISA`, the user's cap on it, is read there and nowhere else).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


def _cpuinfo_flags_line() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return None


def cpu_fingerprint() -> str:
    return _cpuinfo_flags_line() or platform.processor() or platform.machine()


@functools.cache  # read once
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (/proc/cpuinfo: "avx512_bf16", "avx512_vnni",
    "amx_bf16", ...); empty where that file is not there (then only portable kernels run)."""
    line = _cpuinfo_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if line and ":" in line else frozenset()


# The dot-product kernels (csrc/dot_matmul.cc) per weight format: the CPU flag their fast path
# needs, and the bit of JaxserveDotIsa() saying the library was built with it; and the AMX tiles'.
DOT_PATHS = {"bfloat16": ("avx512_bf16", 1), "w8a8": ("avx512_vnni", 2), "w4a8": ("avx512_vnni", 2),
             "q8a8": ("avx512_vnni", 2), "mxfp4a8": ("avx512_vnni", 2)}
AMX_PATHS = {"bfloat16": "amx_bf16", "w8a8": "amx_int8", "w4a8": "amx_int8", "q8a8": "amx_int8",
             "mxfp4a8": "amx_int8"}
AMX_BIT = 4
ISA_ENV = "JAXSERVE_CPU_ISA"  # "portable" / "avx512": cap the instructions below what the CPU has
ISA_CHOICES = ("auto", "avx512", "portable")


def isa_cap(cap: str | None = None) -> str:
    """`cap` (one of ISA_CHOICES) checked; None: the user's `$JAXSERVE_CPU_ISA` (unset: auto), read
    here, when cpu_kernels.choose_isa is asked for the backend's choice, never at trace time."""
    if cap is None:
        cap = os.environ.get(ISA_ENV, "auto")
    if cap not in ISA_CHOICES:
        raise ValueError(f"${ISA_ENV}={cap!r}: expected one of {', '.join(ISA_CHOICES)} (unset means auto)")
    return cap
