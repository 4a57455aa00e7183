"""EngineConfig: every knob a user can set, validated up front with errors that name the fix.

One source of defaults: the scheduler's knobs are the fields of `core.scheduler_config.SchedulerConfig`
(EngineConfig holds them as `scheduler`, and `scheduler_config()` adds what the engine derives:
blocks, lengths, batch limits); the CLI's flags and `--help` are generated from these dataclass
fields (`args.add_config_args`), so nothing is written twice.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Any

from jaxserve.core.scheduler_config import ADMISSIONS, EVICTIONS, POLICIES, PREFIX_CACHES, SchedulerConfig
from jaxserve.errors import UserError

ATTENTION_BACKENDS = ("cpu", "xla", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
KV_QUANT_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")  # pallas_kernels/kv_quant.py: per-(token, head) scales
# runtime/weight_formats.py
QUANTIZATIONS = ("int8", "fp8", "q8_0", "q4_0", "q4_1", "gguf", "bfloat16", "w8a8", "w4a8", "q4_k", "q6_k",
                 "mxfp4a8")
QUANTIZATION_CHOICES = (*QUANTIZATIONS, "none")  # none: weights in --dtype, unquantized (float32 on CPU: exact)
SCHEDULES = POLICIES

# Scheduler fields the engine sets itself (from its own fields or the memory budget).
DERIVED_SCHEDULER_FIELDS = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                            "max_num_logit_rows")


def _knob(default, help: str, *, choices=None, flag: str | None = None, aliases=(), metavar=None, **kw):
    meta = {"help": help, "choices": choices, "flag": flag, "aliases": tuple(aliases), "metavar": metavar}
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _sched(name: str):
    return next(f.default for f in fields(SchedulerConfig) if f.name == name)


@dataclass
class EngineConfig:
    model: str | None = _knob(None, "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
                              aliases=("-m",))
    max_model_len: int | None = _knob(None, "longest prompt + output (default: the model's)")
    max_num_seqs: int = _knob(_sched("max_num_seqs"), "sequences per step")
    max_num_batched_tokens: int = _knob(_sched("max_num_batched_tokens"),
                                        "token budget per step (prefills are chunked to fit)")
    block_size: int = _knob(_sched("block_size"), "tokens per KV block (a power of two)")
    kv_cache_memory: int | None = _knob(None, "KV cache budget, e.g. 2GiB (default: --gpu-memory-utilization of "
                                        "the device's memory after weights; at most 1GiB on CPU)", metavar="BYTES")
    gpu_memory_utilization: float = _knob(0.9, "fraction of device memory the engine may use (weights, "
                                          "activations and KV cache); on GPU jax's memory pool is made that "
                                          "size unless XLA_CLIENT_MEM_FRACTION is set", aliases=("--memory-fraction",))
    num_blocks: int | None = _knob(None, "KV blocks, overriding the memory budget (tests, simulations)")
    prefix_cache: str = _knob(_sched("prefix_cache"), "prefix cache design", choices=PREFIX_CACHES)
    eviction: str = _knob(_sched("eviction"), "prefix cache eviction: lru, or trunk (keep shared prefixes, drop "
                          "leaf tips first)", choices=EVICTIONS)
    schedule: str = _knob(_sched("policy"), "admission order (lpm: longest cached prefix first, with aging)",
                          choices=SCHEDULES)
    prefill_first: bool = _knob(_sched("prefill_first"), "admit new prompts before running decodes "
                                "(--no-prefill-first / --decode-first: running requests first)",
                                aliases=("!--decode-first",))
    burst_prefill_first: bool = _knob(_sched("burst_prefill_first"), "in a burst of arrivals (as many requests "
                                      "waiting for their first token as decoding) a step carries prefill chunks alone, "
                                      "the decodes run once none is left: each stream waits once for the burst "
                                      "instead of at every chunk step")
    admission: str = _knob(_sched("admission"), "optimistic (vLLM): admit while the prompt fits; conservative "
                           "(SGLang): also reserve blocks for running requests' expected output", choices=ADMISSIONS)
    lpm_max_wait_steps: int = _knob(_sched("lpm_max_wait_steps"), "lpm aging: steps a request may be passed over")
    lpm_max_queue: int = _knob(_sched("lpm_max_queue"), "lpm falls back to fcfs above this many waiting requests")
    watermark: float = _knob(_sched("watermark"), "fraction of blocks admission keeps free for running requests")
    init_new_token_ratio: float = _knob(_sched("init_new_token_ratio"),
                                        "conservative admission: share of max_tokens expected still to come")
    dedup_in_batch: bool = _knob(_sched("dedup_in_batch"),
                                 "defer a request whose uncached prefix another request is computing")
    hash_seed: int = _knob(_sched("hash_seed"), "seed of the prefix cache's block hashes")
    attention_backend: str | None = _knob(None, "default: pallas on TPU/GPU; on CPU the native cpu kernels "
                                          "(built with g++), else xla", choices=ATTENTION_BACKENDS)
    dtype: str | None = _knob(None, "weights and activations (default: float32 on CPU, bfloat16 on TPU/GPU)",
                              choices=DTYPES)
    kv_cache_dtype: str | None = _knob(None, "KV cache storage (default: --dtype, but bfloat16 for a bfloat16 or "
                                       "quantized checkpoint run in float32); int8, fp8_e4m3, fp8_e5m2: "
                                       "quantized with one float32 scale per token and kv head (~1.9x the "
                                       "blocks of bfloat16 at head_dim 64)", choices=DTYPES + KV_QUANT_DTYPES)
    tensor_parallel_size: int = _knob(1, "shard the model over N devices", aliases=("--tp",))
    enable_expert_parallel: bool = _knob(False, "mixture-of-experts models: split whole experts over the "
                                         "tensor-parallel devices (E / N experts each) instead of every expert's "
                                         "intermediate axis; attention stays tensor-parallel")
    quantization: str | None = _knob(None, "keep the weights quantized: int8 or fp8 (e4m3, per output channel), "
                                     "q8_0, q4_0, "
                                     "q4_1, q4_k, q6_k (GGUF's blocks) made at load from any checkpoint; gguf: "
                                     "a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks as stored; bfloat16 (weights and "
                                     "activations rounded to bfloat16, float32 sums), w8a8 (int8 weights "
                                     "per channel, int8 activations per block of 32) and w4a8 (q4_1's blocks, a "
                                     "GGUF's Q4_0/Q4_1 as stored, times int8 activations) on the CPU's "
                                     "dot-product instructions; mxfp4a8: a checkpoint's MXFP4 experts (gpt-oss) "
                                     "as stored times int8 activations on them too (other weights as without "
                                     "--quantization; the default, exact path keeps float32 activations); none: "
                                     "unquantized, in --dtype (float32 on CPU: "
                                     "exact). Default: on CPU, gguf for a GGUF of those blocks where the CPU has "
                                     "int8 dot products (VNNI/AMX), bfloat16 for a bfloat16 checkpoint where it has "
                                     "bfloat16 ones, else none (jaxserve/default_format.py)",
                                     choices=QUANTIZATION_CHOICES)
    speculative_config: str | None = _knob(
        None, 'speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft", "model": PATH, '
        '"num_speculative_tokens": 4}; "disable_by_batch_size": N turns it off above N running requests',
        metavar="JSON")
    async_scheduling: bool = _knob(True, "dispatch step n+1 before reading step n's tokens, so host work "
                                   "overlaps the device")
    itl_target_ms: float | None = _knob(
        None, "inter-token latency target: a step with decode rows takes only the prefill tokens that keep it "
        "within this many ms, from measured step times (default: 3x a decode-only step; 0: off, prefill chunks "
        "fill --max-num-batched-tokens)", metavar="MS")
    precompile: bool = _knob(True, "compile every step bucket at start-up (else on first use)")
    background_compile: bool = _knob(True, "serve: be ready once the largest step bucket is compiled and compile "
                                     "the others on a background thread (steps run on compiled buckets meanwhile)")
    compilation_cache: bool = _knob(True, "use JAX's persistent compilation cache")
    seed: int = _knob(0, "seeds the per-request seeds of requests that bring none")
    score_tokens: str | None = _knob(None, "rerank / score: the 'no' and 'yes' answer tokens whose last-position "
                                     "logits score a document (Qwen3-Reranker's way; default: no,yes)",
                                     metavar="NO,YES")

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> UserError:
            return UserError(f"Invalid {name}={getattr(self, name)!r}: {rule}.", param=name)

        def positive(name: str, minimum: int = 1) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < minimum):
                raise bad(name, f"must be an integer >= {minimum}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            positive(name)
        positive("num_blocks", 2)
        if self.block_size & (self.block_size - 1):
            raise bad("block_size", "must be a power of two (e.g. 16)")
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        positive("kv_cache_memory")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise bad(f.name, f"choose one of {', '.join(choices)}")
        self.speculative = SpeculativeConfig.parse(self.speculative_config)  # parsed, checked
        try:
            self.scheduler_config(num_blocks=2, max_model_len=2)  # the scheduler's own checks
        except ValueError as e:
            raise UserError(str(e)) from None

    @property
    def memory_fraction(self) -> float:  # the older name of gpu_memory_utilization
        return self.gpu_memory_utilization

    def scheduler_config(self, *, num_blocks: int, max_model_len: int, **derived) -> SchedulerConfig:
        own = {f.name for f in fields(SchedulerConfig)} - set(DERIVED_SCHEDULER_FIELDS) - {"policy"}
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_model_len, policy=self.schedule,
            **{name: getattr(self, name) for name in own - set(derived)}, **derived,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "tb": 1e12}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise UserError(f"Invalid memory size {text!r}: use a number with an optional unit, e.g. 2GiB or 512MiB.",
                        param="kv_cache_memory")
    return int(float(m[1]) * _UNITS[m[2].lower()])


# --- `--speculative-config` (vLLM's shape): {"method": "ngram", "num_speculative_tokens": k,
# "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft", "model": PATH, ...}.

METHODS = ("ngram", "draft")
# Above this many running sequences a step verifies no drafts (vLLM: disable_by_batch_size). On a
# CPU each draft row costs about as much compute as a sequence's decode row, so speculation pays
# only while the step is bound by reading the weights: measured on the default model (2 cores,
# bench/spec_decode.py --sweep; bench/RESULTS.md), forced on at 8 running it gave +53% on
# repetitive and -3% on fresh prompts, at 16 +7% and -9%.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up (tried first)
    model: str | None = None  # draft: the draft model (same tokenizer as the target)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict, a JSON/YAML string (the CLI flag), or a SpeculativeConfig."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import yaml

            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                value = None
        if not isinstance(value, dict):
            raise UserError('--speculative-config must be a JSON object, e.g. '
                            '\'{"method": "ngram", "num_speculative_tokens": 4}\'.', param="speculative_config")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise UserError(f"Unknown speculative_config key {unknown[0]!r}: use {', '.join(sorted(names))}.",
                            param="speculative_config")
        cfg = cls(**value)
        cfg.check()
        return cfg

    def check(self) -> None:
        def bad(name: str, rule: str) -> UserError:
            return UserError(f"Invalid speculative_config {name}={getattr(self, name)!r}: {rule}.",
                             param="speculative_config")

        if self.method not in METHODS:
            raise bad("method", f"choose one of {', '.join(METHODS)}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                         ("disable_by_batch_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise bad(name, f"must be an integer >= {lo}")
        if self.num_speculative_tokens > 16:
            raise bad("num_speculative_tokens", "must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must not exceed prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and not self.model:
            raise bad("model", 'the draft method needs "model": a directory or .gguf of a smaller model '
                      "with the target's tokenizer")
