"""The weight format a model runs in when the user names none (issue 26): the fastest path this
machine has whose quality stays that of float32, chosen from what the checkpoint stores and what
the CPU's dot-product instructions are.

    GGUF whose layers' matrices are Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks, on a CPU with
        bfloat16 dot products, its weights in bfloat16
        at most a quarter of the machine's memory        -> "bfloat16": the blocks expanded to
                                                            bfloat16 at load
        else VNNI (avx512_vnni, avx_vnni) or AMX-int8    -> "gguf": the blocks as stored, decoded
                                                            in the native kernel, float32 activations
    bfloat16 checkpoint (safetensors, or a BF16 GGUF), on a CPU
        with bfloat16 dot products (avx512_bf16, amx_bf16) -> "bfloat16": bfloat16 weights and
                                                            matmul inputs, float32 sums
    anything else                                       -> "none": float32, as before

It applies only where the user gave neither `--quantization` nor `--dtype`, on CPU, with one device
(tensor parallel 1) and the native CPU kernels (the formats above are theirs). "none" (also a
`--quantization` value) means no quantization: weights in the compute dtype, float32 on CPU, the
exact path. Measured on the shipped model (bench/RESULTS.md "Default weight format"): gguf reads
the file's values exactly, same perplexity as float32, faster at 1 and 32 streams; bfloat16 is
faster still where the CPU has bfloat16 dot products (level at 1 stream, 1.6-1.7x at 32: its
prefill runs on AMX tiles / vdpbf16ps, the blocks' on float32 FMAs) within 1% of float32's
perplexity (-0.2%; greedy parts from float32 only on near-ties), so by the issue's rule (the fastest
at 1 and 32 streams within 1% perplexity) it is the default there, while its weights (2 bytes a
parameter, ~3x the 4-bit blocks') fit: at most a quarter of the memory. Larger GGUFs keep their
blocks (`--quantization bfloat16` expands them anyway). w4a8 was faster still but not kept (it
parted from float32's greedy answers on near-ties and cost ~1% perplexity).

A gpt-oss checkpoint's MXFP4 experts run as stored in every case (decoded in the native kernel,
float32 activations: exact); `--quantization mxfp4a8` (int8 activations on them, faster, not exact)
is never chosen by default, as w4a8 is not.

No jax here: the engine passes the platform and whether the native kernels are built.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxserve.model.loader import resolve_model_path
from jaxserve.runtime import cpu_isa, cpu_kernels, weight_formats

KEPT_BLOCKS = frozenset(weight_formats.GGUF_KEPT_TYPES)
FLOAT_TYPES = {"F32": "float32", "F64": "float32", "F16": "float16", "BF16": "bfloat16"}
INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")  # Linux's /proc/cpuinfo names
BF16_DOT = ("avx512_bf16", "amx_bf16")
BF16_MEMORY_SHARE = 4  # a GGUF is expanded to bfloat16 by default while that takes <= 1/4 of memory
EXACT = "exact float32: --quantization none or --dtype float32"


@dataclass(frozen=True)
class Checkpoint:
    """What the default needs to know of a checkpoint, read from its header / config.json only."""

    kind: str  # "gguf", "safetensors", "orbax" (`jaxserve convert` output) or "other"
    dtype: str | None = None  # the stored float dtype of its weights: float32 / bfloat16 / float16
    block_types: frozenset[str] = field(default_factory=frozenset)  # GGUF: its layers' quantized matrices' types
    quantized: bool = False  # safetensors: config.json declares a quantization_config (fp8, mxfp4, ...)
    num_params: int = 0  # GGUF: elements of all its tensors (0: not read)


def inspect_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint's kind, stored dtype and (GGUF) block types, from its header: no weights read."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from jaxserve.model.gguf_loader import GGUFFile  # imports gguf: only for a GGUF file

        g = GGUFFile(path)
        layers = [i.type_name for n, i in g.tensors.items() if n.startswith("blk.") and len(i.shape) == 2]
        blocks = frozenset(t for t in layers if t not in FLOAT_TYPES)
        floats = {FLOAT_TYPES[t] for t in layers if t in FLOAT_TYPES}
        # a float file's dtype: that of its layers' matrices, where they agree (small float
        # matrices beside quantized ones, a router say, do not make a quantized file a float one)
        dtype = floats.pop() if len(floats) == 1 and not blocks else None
        num_params = sum(math.prod(i.shape) for i in g.tensors.values())
        return Checkpoint("gguf", dtype, blocks, num_params=num_params)
    if path.is_dir() and (path / "jaxserve_orbax.json").is_file():
        return Checkpoint("orbax")
    if path.is_dir() and (path / "config.json").is_file():
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return Checkpoint("other")  # the loader names what is wrong with it
        name = str(hf.get("torch_dtype") or hf.get("dtype") or "").removeprefix("torch.")
        name = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)
        dtype = name if name in ("float32", "bfloat16", "float16") else None
        return Checkpoint("safetensors", dtype, quantized=bool(hf.get("quantization_config")))
    return Checkpoint("other")


def _has(features, flags) -> list[str]:
    return [f for f in flags if f in features]


def physical_memory() -> int:
    """This machine's memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_quantization(checkpoint: Checkpoint, cpu_features, platform: str,
                         memory_bytes: int = 0) -> tuple[str, str]:
    """(the `--quantization` value to run, why) for a checkpoint on this platform and CPU (with
    `memory_bytes` of memory; 0: unknown), when the user named none: "gguf", "bfloat16" or "none"
    (see the module docstring)."""
    if platform != "cpu":
        return "none", f"no weight format is chosen by default on {platform}"
    if checkpoint.kind == "gguf" and checkpoint.block_types:
        types = "/".join(sorted(checkpoint.block_types))
        if not checkpoint.block_types <= KEPT_BLOCKS:
            other = "/".join(sorted(checkpoint.block_types - KEPT_BLOCKS))
            return "none", f"the GGUF's {other} blocks have no kernel of their own: dequantized to float32"
        bf16 = _has(cpu_features, BF16_DOT)
        need = 2 * checkpoint.num_params
        if bf16 and need and need * BF16_MEMORY_SHARE <= memory_bytes:
            return "bfloat16", (f"--quantization bfloat16 (default on this CPU, which has {', '.join(bf16)}): the "
                                f"GGUF's {types} blocks expanded to bfloat16 ({need / 2**20:,.0f} MiB), bfloat16 "
                                "matmul inputs, float32 sums; --quantization gguf keeps the blocks as stored "
                                "(~3x less memory)")
        dot = _has(cpu_features, INT8_DOT)
        if not dot:
            return "none", (f"the GGUF's {types} blocks dequantized to float32: this CPU has no int8 dot "
                            f"products ({', '.join(INT8_DOT)})")
        return "gguf", (f"--quantization gguf (default on this CPU, which has {', '.join(dot)}): the GGUF's {types} "
                        "blocks as stored, float32 activations")
    if checkpoint.dtype == "bfloat16" and checkpoint.kind in ("safetensors", "gguf") and not checkpoint.quantized:
        dot = _has(cpu_features, BF16_DOT)
        if not dot:
            return "none", "bfloat16 checkpoint computed in float32: this CPU has no bfloat16 dot products"
        return "bfloat16", (f"--quantization bfloat16 (default on this CPU, which has {', '.join(dot)}, for a bfloat16 "
                            "checkpoint): bfloat16 weights and matmul inputs, float32 sums")
    return "none", "float32"


def choose(config, checkpoint: Callable[[], Checkpoint], platform: str, cpu_features,
           native_kernels: Callable[[], str | None]) -> tuple[str, str | None]:
    """(the `--quantization` value the engine runs, the start-up log line or None) for an
    EngineConfig. An explicit --quantization is kept (None for none); an explicit --dtype means no
    quantization; otherwise the default applies on CPU with one device and the native kernels.
    `checkpoint` is read and `native_kernels` (cpu_kernels.available: None when built, else why
    not) called only when needed."""
    if config.quantization is not None:
        return config.quantization, None
    if config.dtype is not None or platform != "cpu":
        return "none", None
    why_not = None
    if config.tensor_parallel_size != 1:
        why_not = f"tensor parallel {config.tensor_parallel_size}"
    elif config.attention_backend not in (None, "cpu"):
        why_not = f"attention backend {config.attention_backend}"
    elif config.kv_cache_dtype == "float16":
        why_not = "float16 KV cache (the native kernels take float32, bfloat16, int8 or fp8)"
    quantization, why = default_quantization(checkpoint(), cpu_features, platform, physical_memory())
    if quantization != "none" and why_not is None and (err := native_kernels()) is not None:
        why_not = f"native CPU kernels unavailable: {err}"
    if quantization != "none" and why_not is not None:
        return "none", (f"Weights: float32 (the default format here, {quantization}, needs one device and the native "
                        f"CPU kernels: not with {why_not}).")
    if quantization == "none":
        return "none", f"Weights: {why} (the default on this machine)."
    return quantization, f"Weights: {why}; {EXACT}."


def for_engine(config) -> str:
    """choose() on this process's platform, CPU and native kernels; logs the line once."""
    quantization, why = choose(config, lambda: inspect_checkpoint(resolve_model_path(config.model)),
                               jax.default_backend(), cpu_isa.cpu_features(), cpu_kernels.available)
    if why:
        logging.getLogger("jaxserve").info(why)
    return quantization
