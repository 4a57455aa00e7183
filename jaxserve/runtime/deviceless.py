"""The target's own compiler on a host without the target: XLA:GPU deviceless and libtpu compile-only.

A GPU target is a GpuTargetConfigProto text file (``configs/targets/<name>.txtpb``, or any file
given by path) handed to ``get_topology_desc(platform="cuda", target_config=...)``; a TPU target is
one of libtpu's compile-only topologies (``get_topology_desc(platform="tpu", topology_name=
"v5e:2x2")``). Either gives devices to lay ``ShapeDtypeStruct``s out on, and
``jax.jit(f).lower(...).compile()`` then runs everything the device would at start-up except
autotuning: Mosaic GPU's passes, LLVM NVPTX and ptxas for sm_90a, or Mosaic TPU and XLA:TPU.
Nothing executes, so numerics stay the interpreter's job and speed the device's.

The compilers come with two extras: ``jaxserve[compile-cuda]`` (the CUDA plugin; ptxas and libdevice
from NVIDIA's ``nvidia-cuda-nvcc``/``nvidia-nvvm`` wheels, never a system toolkit on PATH) and
``jaxserve[compile-tpu]`` (libtpu). Both need the environment set before jax starts its backends
(``prepare_env``): jax on CPU (a libtpu on the path must not try to claim a TPU), the CUDA version
check off (no driver here), XLA pointed at the wheel's CUDA directory, and Mosaic GPU asked to print
ptxas' resource usage, which ``capture_output`` reads back from the process' stdout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxserve.errors import UserError
from jaxserve.runtime import compat

TARGET_DIR = Path(__file__).resolve().parents[2] / "configs" / "targets"
GPU_TARGETS = ("h100", "h200", "b200")
# libtpu's compile-only topologies, smallest first for each generation (the first with enough chips
# is used); VMEM per core and SMEM per core from the chips' published figures.
TPU_TOPOLOGIES = {
    "v5e": ("v5e:2x2", "v5e:2x4"),
    "v6e": ("v6e:2x2", "v6e:2x4"),
    "v5p": ("v5p:2x2x1", "v5p:2x2x2"),
    "v7x": ("v7x:2x2x1", "v7x:2x2x2"),
}
TPU_MEMORY_GIB = {"v5e": 16, "v6e": 32, "v5p": 95, "v7x": 192}
TPU_VMEM_BYTES = {"v5e": 128 << 20, "v6e": 128 << 20, "v5p": 128 << 20, "v7x": 64 << 20}
EXTRA = {"cuda": "compile-cuda", "tpu": "compile-tpu"}


def install_line(platform: str) -> str:
    return f"pip install 'jaxserve[{EXTRA[platform]}]'"


def cuda_dir() -> Path | None:
    """The CUDA directory of NVIDIA's pip wheels (``nvidia/cu13``: bin/ptxas, nvvm/libdevice)."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cuda_nvcc"):
            d = Path(root) / sub
            if (d / "bin" / "ptxas").is_file() and any((d / "nvvm" / "libdevice").glob("libdevice*.bc")):
                return d
    return None


def missing(platform: str) -> str | None:
    """None when this host can compile for ``platform``, else the one line naming the extra."""
    if platform == "cuda":
        have = importlib.util.find_spec("jax_plugins") is not None and any(
            importlib.util.find_spec(f"jax_plugins.{m}") is not None for m in ("xla_cuda13", "xla_cuda12"))
        if not have or cuda_dir() is None:
            what = "the CUDA plugin" if not have else "ptxas and libdevice from NVIDIA's wheels"
            return f"compiling for cuda needs {what}: {install_line('cuda')}"
        return None
    if platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return f"compiling for tpu needs libtpu: {install_line('tpu')}"
        return None
    raise UserError(f"Unknown platform {platform!r}: choose cuda or tpu.", param="platform")


def prepare_env(platforms: tuple[str, ...] = ("cuda", "tpu")) -> None:
    """Set what the compilers read; call before anything starts jax's backends."""
    if compat.backends_started() and os.environ.get("JAX_PLATFORMS") != "cpu":
        raise RuntimeError("deviceless compile: jax started its backends before prepare_env(); "
                           "call it first (it sets JAX_PLATFORMS=cpu and the CUDA directory)")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "tpu" in platforms:  # compile-only: no TPU to lock, no metadata server to ask
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # no driver or cuDNN here: the CUDA plugin (installed for either platform's run) must not check
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if "cuda" in platforms:
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
        d = cuda_dir()
        flags = os.environ.get("XLA_FLAGS", "")
        if d is not None and "--xla_gpu_cuda_data_dir" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={d}".strip()


@dataclass(frozen=True)
class Target:
    """A device to compile for: its platform, name and the facts the budgets need."""

    platform: str  # cuda | tpu
    name: str  # h200, v5e, or a GpuTargetConfig file's stem
    config: str  # GpuTargetConfigProto text (cuda) or the first topology name (tpu)
    compute_capability: str | None  # "9.0" (cuda)
    memory_bytes: int
    smem_bytes: int = 0  # opt-in shared memory per block (cuda)
    vmem_bytes: int = 0  # VMEM per core (tpu)

    def devices(self, n: int) -> list:
        """``n`` devices of this target's topology (compile-only; nothing runs on them)."""
        from jax.experimental import topologies

        if self.platform == "cuda":
            topo = topologies.get_topology_desc(platform="cuda", target_config=self.config, topology=f"1x1x{n}")
            return list(topo.devices)[:n]
        for name in TPU_TOPOLOGIES[self.name]:
            with capture_output():  # libtpu's start-up complaints about the host it is not on
                devs = list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
            if len(devs) >= n:
                return devs[:n]
        raise UserError(f"TPU {self.name}: no compile-only topology here has {n} chips.",
                        param="tensor_parallel_size")


def _field(text: str, name: str) -> int | None:
    m = re.search(rf"\b{name}\s*:\s*([0-9.]+)", text)
    return int(float(m.group(1))) if m else None


def target(platform: str, name: str) -> Target:
    """The named target (``h200``, ``v5e``...) or, for cuda, a GpuTargetConfigProto text file."""
    if platform == "cuda":
        path = TARGET_DIR / f"{name}.txtpb" if name in GPU_TARGETS else Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"Unknown GPU target {name!r}: choose one of {', '.join(GPU_TARGETS)} or pass a "
                            "GpuTargetConfigProto text file.", param="target")
        text = path.read_text()
        cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
        if cc is None:
            raise UserError(f"{str(path)!r} has no cuda_compute_capability: pass a GpuTargetConfigProto text file.",
                            param="target")
        major, minor = _field(cc.group(1), "major") or 0, _field(cc.group(1), "minor") or 0
        return Target("cuda", path.stem, text, f"{major}.{minor}", _field(text, "device_memory_size") or 0,
                      smem_bytes=_field(text, "shared_memory_per_block_optin") or 0)
    if platform == "tpu":
        if name not in TPU_TOPOLOGIES:
            raise UserError(f"Unknown TPU target {name!r}: choose one of {', '.join(TPU_TOPOLOGIES)}.",
                            param="target")
        return Target("tpu", name, TPU_TOPOLOGIES[name][0], None, TPU_MEMORY_GIB[name] << 30,
                      vmem_bytes=TPU_VMEM_BYTES[name])
    raise UserError(f"Unknown platform {platform!r}: choose cuda or tpu.", param="platform")


# --- what the compilers report ----------------------------------------------------------------


@dataclass
class KernelReport:
    """One Mosaic GPU kernel as ptxas saw it (registers per thread, spills in bytes) with the
    dynamic shared memory Mosaic launched it with."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int | None = None

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[KernelReport]:
    """Every entry function in ptxas' ``-v`` output (``MOSAIC_GPU_DUMP_PTXAS=1``), in order."""
    out: list[KernelReport] = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        entry = _PTXAS_ENTRY.search(block)
        regs = _PTXAS_REGS.search(block)
        if not entry or not regs:
            continue
        spill = _PTXAS_SPILL.search(block)
        stack, stores, loads = (int(g) for g in spill.groups()) if spill else (0, 0, 0)
        out.append(KernelReport(entry.group(1), int(regs.group(1)), stores, loads, stack))
    return out


@contextlib.contextmanager
def capture_output() -> Iterator[list[str]]:
    """Everything written to this process' stdout and stderr (file descriptors 1 and 2, so the
    compilers' C++ prints too) while the block runs, as one string in the yielded list."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    result: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield result
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            result.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def record_smem() -> Iterator[list[int]]:
    """The dynamic shared memory of each Mosaic GPU kernel lowered inside the block, in bytes."""
    with compat.mosaic_gpu_smem_sizes() as sizes:
        yield sizes


@dataclass
class CompileReport:
    ok: bool
    seconds: float  # wall clock
    cpu_seconds: float  # this process and its children (ptxas): steadier than wall on a busy host
    temp_bytes: int | None = None  # the executable's temporaries (memory_analysis)
    kernels: list[KernelReport] = field(default_factory=list)
    error: str | None = None
    # Mosaic GPU kernels lowered but not handed to ptxas: identical to one compiled earlier in
    # this process (Mosaic caches them), whose figures stand for them
    cached_kernels: int = 0
    log: str = ""  # what the compilers printed besides ptxas' lines (warnings), trimmed

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("log")
        return d


def first_line(e: BaseException) -> str:
    """The compiler's verdict in one line: its first non-blank line (where Mosaic puts the reason)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = lines[0] if lines else ""
    if head.rstrip(":").endswith("Mosaic failed to compile TPU kernel") and len(lines) > 1:
        head = f"{head} {lines[1]}"
    return f"{type(e).__name__}: {head[:400]}"


def compile_report(lower: Callable[[], object]) -> CompileReport:
    """Lower and compile (``lower()`` returns a ``jax.stages.Lowered``), reading back the seconds,
    the temporaries, and ptxas' figures for each Mosaic GPU kernel; a compile error is a report
    with ``ok=False`` and its first line, not an exception."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    with capture_output() as printed, record_smem() as smem:
        try:
            compiled = lower().compile()
            error = None
        except Exception as e:  # the compiler's verdict, reported per bucket / kernel
            compiled, error = None, first_line(e)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    text = printed[0] if printed else ""
    kernels = parse_ptxas(text)
    if len(smem) == len(kernels):  # one ptxas entry per kernel, lowered and compiled in the same order
        for k, size in zip(kernels, smem):
            k.smem_bytes = size
    elif smem:  # identical kernels compiled once: the largest launch stands for each
        for k in kernels:
            k.smem_bytes = max(smem)
    temp = compat.peak_temp_bytes(compiled) if compiled is not None else None
    log = "\n".join(line for line in text.splitlines() if line.strip() and "ptxas" not in line
                    and not line.startswith("    "))[-2000:]
    cached = max(0, len(smem) - len(kernels)) if compiled is not None else 0
    return CompileReport(error is None, seconds, cpu, temp, kernels, error, cached, log)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
