"""The native CPU kernels' build: the C++ sources (`csrc/*.cc`) compiled with the system C++
compiler (`$CXX`, else `g++`/`c++`) against the XLA FFI headers that ship with jaxlib, for this
machine's CPU (-march=native), into one library cached under `$JAXSERVE_CACHE_DIR/kernels`, keyed
by the sources, the flags, jaxlib's version and the CPU, and checked whole before it is loaded
(runtime/cpu_kernels.py loads and registers it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from jaxserve.paths import cache_dir
from jaxserve.runtime.compat import ffi
from jaxserve.runtime.cpu_isa import cpu_fingerprint

logger = logging.getLogger("jaxserve")
CSRC = Path(__file__).with_name("csrc")
# $JAXSERVE_CXXFLAGS is appended (e.g. "-fsanitize=address -g" to check the kernels' memory accesses).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC",
         *os.environ.get("JAXSERVE_CXXFLAGS", "").split()]
# Linking with -ffast-math (GCC < 13) adds crtfastmath.o, whose constructor switches the thread that
# loads the library (Python's main thread, where numpy and XLA's inline thunks run) to flush-to-zero
# and denormals-are-zero for the rest of the process. -ffast-math is for compiling the kernels only.
LINK_FLAGS = [f for f in FLAGS if f not in ("-ffast-math", "-Ofast")]


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build() -> Path:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set $CXX)")
    sources = sorted(CSRC.glob("*.cc"))
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in sources + sorted(CSRC.glob("*.h"))),
                 " ".join([cxx, *FLAGS, "|", *LINK_FLAGS]).encode(), jax.__version__.encode(),
                 cpu_fingerprint().encode()):
        key.update(part)
    out = cache_dir() / "kernels" / f"jaxserve_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        if verified(out):
            return out
        logger.warning("The cached CPU kernel library %s is damaged (truncated or changed): rebuilding it", out)
        out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # One compiler process per source, side by side (the attention source alone takes ~10 s).
        objs = [Path(tmp) / f"{src.stem}.o" for src in sources]
        logs = [Path(tmp) / f"{src.stem}.log" for src in sources]
        procs = []
        for src, obj, log in zip(sources, objs, logs):
            with open(log, "w") as err:  # a file, not a pipe: a chatty compiler cannot block on it
                procs.append(subprocess.Popen([cxx, *FLAGS, "-c", f"-I{ffi.include_dir()}", str(src), "-o", str(obj)],
                                              stdout=subprocess.DEVNULL, stderr=err))
        results = [(proc.wait(), log.read_text()) for proc, log in zip(procs, logs)]
        tmp_so = Path(tmp) / out.name
        if all(rc == 0 for rc, _ in results):
            link = subprocess.run([cxx, *LINK_FLAGS, *map(str, objs), "-o", str(tmp_so)], capture_output=True,
                                  text=True, check=False)
            results.append((link.returncode, link.stderr))
        for rc, err in results:
            if rc != 0:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file
    write_digest(out)
    return out


def digest_path(so: Path) -> Path:
    return so.with_suffix(".so.sha256")


def write_digest(so: Path) -> None:
    """The library's size and sha256 beside it (written atomically after it), checked before
    every load: loading a truncated library kills the process with SIGBUS."""
    data = so.read_bytes()
    tmp = so.with_suffix(f".so.sha256.{os.getpid()}.tmp")
    tmp.write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    os.replace(tmp, digest_path(so))


def verified(so: Path) -> bool:
    """Whether `so` is whole: its digest matches, or (a library cached before digests were
    written) a child process loads it without dying, and then the digest is written."""
    try:
        data = so.read_bytes()
        want = digest_path(so).read_text().split()
    except FileNotFoundError:
        want = None
    except OSError:
        return False
    if want is not None:
        return want == [str(len(data)), hashlib.sha256(data).hexdigest()]
    probe = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(so)],
                           capture_output=True, check=False, timeout=120)
    if probe.returncode != 0:
        return False
    write_digest(so)
    return True
