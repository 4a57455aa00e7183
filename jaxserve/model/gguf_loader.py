"""Load a GGUF file as an HF-style config dict and float32 numpy weights under HF tensor names.

    config, weights = load_gguf("model.gguf")

With `keep_quantized`, Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices stay in their blocks (runtime/weight_formats.py formats).

The header and metadata are parsed here directly (gguf's `GGUFReader` takes ~2 s just to index the
49k-entry vocabulary arrays of a small model; this takes ~0.1 s); dequantization uses
`gguf.quants.dequantize`. Llama-arch q/k weights are stored permuted for llama.cpp's interleaved
RoPE (convert_hf_to_gguf.py `LlamaModel.permute`); the permutation is undone here. Qwen2/Qwen3 are
converted without it (they use NEOX-style RoPE in llama.cpp), so they are left alone.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from jaxserve.errors import UserError
from jaxserve.runtime import weight_formats

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
           10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# ggml tensor types this loader dequantizes: id -> (name, block elements, block bytes)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}

# llama.cpp architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),  # Mistral is Llama-shaped; llama.cpp also calls it llama
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's ne reversed
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"ggml type {self.ggml_type}",))[0]


class GGUFFile:
    """A parsed GGUF header: `.metadata` (dict), `.tensors` (name -> TensorInfo), `.data` (memmap)."""

    def __init__(self, path: os.PathLike | str, keep_arrays: bool = True):
        self.path = str(path)
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"Cannot read GGUF file {self.path}: {e}") from None
        buf = self.data
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise UserError(f"{self.path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version = int(buf[4:8].view("<u4")[0])
        if version < 2:
            raise UserError(f"{self.path}: GGUF version {version} is not supported (need >= 2)")
        n_tensors, n_kv = (int(x) for x in buf[8:24].view("<u8"))
        self._raw = memoryview(buf)
        pos = 24
        self.metadata: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key, pos = self._string(pos)
                vtype = struct.unpack_from("<I", self._raw, pos)[0]
                value, pos = self._value(pos + 4, vtype)
                self.metadata[key] = value
            infos = []
            for _ in range(n_tensors):
                name, pos = self._string(pos)
                ndim = struct.unpack_from("<I", self._raw, pos)[0]
                dims = struct.unpack_from(f"<{ndim}Q", self._raw, pos + 4)
                gtype, off = struct.unpack_from("<IQ", self._raw, pos + 4 + 8 * ndim)
                pos += 4 + 8 * ndim + 12
                infos.append((name, gtype, tuple(reversed(dims)), off))
        except struct.error:
            raise UserError(f"{self.path}: truncated or corrupt GGUF header") from None
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = (pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, gtype, shape, off in infos:
            n = int(np.prod(shape, dtype=np.int64))
            _, blk, bb = GGML_TYPES.get(gtype, (None, 1, 0))
            self.tensors[name] = TensorInfo(name, gtype, shape, start + off, n // blk * bb)

    def _string(self, pos: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", self._raw, pos)[0]
        pos += 8
        return bytes(self._raw[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

    def _value(self, pos: int, vtype: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(pos)
        if vtype in _SCALAR:
            dt = np.dtype(_SCALAR[vtype])
            v = np.frombuffer(self._raw, dt, 1, pos)[0].item()
            return (bool(v) if vtype == _BOOL else v), pos + dt.itemsize
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", self._raw, pos)
            pos += 12
            if itype in _SCALAR:
                dt = np.dtype(_SCALAR[itype])
                arr = np.frombuffer(self._raw, dt, count, pos).copy()
                vals = arr.astype(bool).tolist() if itype == _BOOL else arr.tolist()
                return vals, pos + count * dt.itemsize
            out = []
            for _ in range(count):
                v, pos = self._value(pos, itype)
                out.append(v)
            return out, pos
        raise UserError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, shaped (rows..., bytes per row)."""
        if info.ggml_type not in GGML_TYPES:
            raise UserError(
                f"{self.path}: tensor {info.name!r} has unsupported GGUF quantization type "
                f"{_type_name(info.ggml_type)}; supported: {', '.join(n for n, *_ in GGML_TYPES.values())}"
            )
        _, blk, bb = GGML_TYPES[info.ggml_type]
        row = info.shape[-1]
        if row % blk:
            raise UserError(f"{self.path}: tensor {info.name!r} row length {row} is not a multiple "
                             f"of the {info.type_name} block size {blk}")
        flat = self.data[info.offset:info.offset + info.nbytes]
        if flat.size != info.nbytes:
            raise UserError(f"{self.path}: tensor {info.name!r} runs past the end of the file")
        return flat.reshape(*info.shape[:-1], row // blk * bb)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order."""
        info = self.tensors[name]
        return dequantize_raw(self.raw(info), info.ggml_type, info.shape)


def _type_name(ggml_type: int) -> str:
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except Exception:
        return f"#{ggml_type}"


def dequantize_raw(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF bytes (rows..., row bytes) of type `ggml_type` -> float32 array of `shape`."""
    name = GGML_TYPES[ggml_type][0]
    raw = np.ascontiguousarray(raw)
    if name == "F32":
        out = raw.view("<f4")
    elif name == "F16":
        out = raw.view("<f2").astype(np.float32)
    elif name == "F64":
        out = raw.view("<f8").astype(np.float32)
    elif name == "BF16":
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on q/k rows (n_head = heads of this proj)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's `rope_freqs` factors, if it matches."""
    factor = float(freqs.max())
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        lo_w, hi_w = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        want = np.where(wavelen < hi_w, 1.0,
                        np.where(wavelen > lo_w, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    return None


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(f"{float(x):.7g}")


def checkpoint_dtype(g: GGUFFile) -> str:
    """The float dtype the file's weights stand for, read from the first attention weight: F32 (or
    F64) -> float32, F16 -> float16; BF16 and every quantized type -> bfloat16 (quantized weights
    carry fewer bits than bfloat16; the models behind them are bfloat16 checkpoints)."""
    info = g.tensors.get("blk.0.attn_q.weight")
    name = info.type_name if info else "F32"
    return {"F32": "float32", "F64": "float32", "F16": "float16"}.get(name, "bfloat16")


def gguf_config(g: GGUFFile) -> dict:
    """HF-style config.json dict from GGUF metadata."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{g.path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    model_type, hf_arch = ARCHITECTURES[arch]

    def get(key, default=None):
        return md.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    head_dim = int(get("attention.key_length", hidden // n_head))
    tokens = md.get("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    vocab = get("vocab_size") or (len(tokens) if tokens else None) or (embd.shape[0] if embd else None)
    theta = _f32(get("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": checkpoint_dtype(g),
    }
    if model_type == "llama":
        cfg["mlp_bias"] = False
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in md:
            cfg[hf_key] = int(md[f"tokenizer.ggml.{key}"])
    if get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))

    rope_scaling = None
    stype = get("rope.scaling.type")
    sfactor = get("rope.scaling.factor")
    if stype in ("linear", "yarn") and sfactor and float(sfactor) != 1.0:
        rope_scaling = {"rope_type": stype, "factor": _f32(sfactor)}
        orig = get("rope.scaling.original_context_length")
        if stype == "yarn" and orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif stype not in (None, "none", "linear", "yarn"):
        raise UserError(f"{g.path}: unsupported rope scaling type {stype!r}")
    if "rope_freqs.weight" in g.tensors:
        freqs = g.dequantize("rope_freqs.weight").astype(np.float64)
        if not np.allclose(freqs, 1.0):
            rope_scaling = _llama3_rope_scaling(freqs, head_dim, theta)
            if rope_scaling is None:
                raise UserError(f"{g.path}: rope_freqs.weight does not match a llama3 rope scaling")
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    return cfg


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name; None for tensors folded into the config (rope_freqs)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise KeyError(gguf_name)


KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")  # block types `keep_quantized` holds as stored


def kept_quantized(g: GGUFFile, info: TensorInfo, qk_heads: int | None):
    """Tensor `info` in its quantized format (runtime/weight_formats.py: the [in, out] kernel's panels), or
    None where it is dequantized instead (another type, or a shape without whole panels).
    qk_heads: the heads of a llama-permuted q/k projection, whose rows are put back in order."""
    if info.type_name not in KEPT_TYPES or len(info.shape) != 2 or not weight_formats.quantizable(
            info.shape[::-1], weight_formats.block_of(info.type_name)):
        return None
    raw = g.raw(info)  # (out rows, bytes per row): a permutation of rows applies to it as is
    return weight_formats.from_gguf(raw if qk_heads is None else unpermute_qk(raw, qk_heads), info.type_name)


def load_gguf(path: os.PathLike | str, keep_quantized: bool = False) -> tuple[dict, dict[str, Any]]:
    """(HF-style config dict, {HF tensor name: float32 ndarray in HF shape}) for a GGUF model file.
    With `keep_quantized`, 2-D tensors of a KEPT_TYPES type stay in their blocks instead, as the
    quantized format of their [in, out] kernel (no float copy is made of them)."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"GGUF file not found: {path}")
    g = GGUFFile(path)
    cfg = gguf_config(g)
    arch = g.metadata["general.architecture"]
    for info in g.tensors.values():  # fail before any work on an unsupported type
        if info.ggml_type not in GGML_TYPES:
            g.raw(info)
    weights: dict[str, np.ndarray] = {}
    for name, info in g.tensors.items():
        try:
            hf = hf_tensor_name(name)
        except KeyError:
            raise UserError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}") from None
        if hf is None:
            continue
        heads = None
        if arch in _PERMUTED_QK and ".attn_q." in name:
            heads = cfg["num_attention_heads"]
        elif arch in _PERMUTED_QK and ".attn_k." in name:
            heads = cfg["num_key_value_heads"]
        if keep_quantized and (kept := kept_quantized(g, info, heads)) is not None:
            weights[hf] = kept
            continue
        w = g.dequantize(name)
        weights[hf] = w if heads is None else unpermute_qk(w, heads)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in weights]
    if missing:
        raise UserError(f"{path}: missing tensors {missing}")
    return cfg, weights
