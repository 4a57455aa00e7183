"""EngineConfig: every knob a user can set, validated up front with errors that name the fix."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

PREFIX_CACHES = ("radix", "hash", "off")
EVICTIONS = ("lru", "trunk")
SCHEDULES = ("fcfs", "priority", "lpm")
ADMISSIONS = ("optimistic", "conservative")
ATTENTION_BACKENDS = ("xla", "pallas", "cpu")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, or None for the embedded default
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default: memory_fraction of free device memory
    memory_fraction: float = 0.9
    num_blocks: int | None = None  # overrides the memory budget (tests, simulations)
    prefix_cache: str = "radix"
    eviction: str = "lru"
    schedule: str = "fcfs"
    prefill_first: bool = False
    admission: str = "optimistic"  # conservative: reserve for running requests' growth (SGLang)
    attention_backend: str | None = None  # default: cpu (native kernel, else xla) on CPU, pallas on TPU/GPU
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on accelerators
    kv_cache_dtype: str | None = None  # default: dtype; bfloat16 for a bfloat16 checkpoint computed in float32
    precompile: bool = True
    compilation_cache: bool = True
    seed: int = 0  # seeds the per-request seeds of requests that bring none
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < minimum):
                raise ValueError(f"Invalid {name}={v!r}: must be an integer >= {minimum}.")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            positive(name)
        positive("num_blocks", 2)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"Invalid block_size={self.block_size}: must be a power of two (e.g. 16).")
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        positive("kv_cache_memory")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"Invalid memory_fraction={self.memory_fraction!r}: must be in (0, 1].")
        for name, allowed in (
            ("prefix_cache", PREFIX_CACHES),
            ("eviction", EVICTIONS),
            ("schedule", SCHEDULES),
            ("admission", ADMISSIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}.")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"Invalid attention_backend={self.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}."
            )
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in (None, *DTYPES):
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: choose one of {', '.join(DTYPES)}.")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "tb": 1e12}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise ValueError(f"Invalid memory size {text!r}: use a number with an optional unit, e.g. 2GiB or 512MiB.")
    return int(float(m[1]) * _UNITS[m[2].lower()])
