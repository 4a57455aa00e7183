"""Load a GGUF file as an HF-style config dict and float32 numpy weights under HF tensor names.

    config, weights = load_gguf("model.gguf")

Architectures (model/gguf_arch.py: what each one's metadata and tensor names mean): llama, mistral,
qwen2, qwen3, gemma3, qwen3moe, qwen2moe, llama with experts (Mixtral), glm4moe, gpt-oss (its MXFP4
experts, ggml type 39, stay packed: converted at load to runtime/mxfp4.py's layout, uint8 only).
With `keep_quantized`, 2-D Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices stay in their blocks (runtime/weight_formats.py
formats), and so do stacked expert tensors (`ffn_*_exps`, [E, out, in]) of those types (Q8_0, Q4_K,
Q6_K as llama.cpp's Q4_K_M writes them), as one ExpertStack of the E experts' kernels
(runtime/expert_matmul.py multiplies them as stored). Otherwise, and for other types, experts are
dequantized to float32 per-expert matrices. With `kernel_dtype` (bfloat16, where the runner will
pack the model as `--quantization bfloat16`), each 2-D tensor that becomes a linear layer's kernel
or the embedding table with a quantized layout is cast to it in the loading threads, right after it
is dequantized: the values the runner would round it to (round to nearest even), without a float32
copy of the whole model held first.

The header and metadata are parsed here directly (gguf's `GGUFReader` takes ~2 s just to index the
49k-entry vocabulary arrays of a small model; this takes ~0.1 s); dequantization uses
`gguf.quants.dequantize`. Llama-arch q/k weights are stored permuted for llama.cpp's interleaved
RoPE (convert_hf_to_gguf.py `LlamaModel.permute`); the permutation is undone here. Qwen2/Qwen3 are
converted without it (they use NEOX-style RoPE in llama.cpp), so they are left alone. Gemma 3's
norms are stored as w + 1; the 1 is taken off here (the model adds it back, as HF's Gemma3RMSNorm).
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from jaxserve.errors import UserError
from jaxserve.model.gguf_arch import (
    EXPERT,
    MXFP4_TYPE,
    NORM_SHIFT,
    PERMUTED_QK,
    WHOLE_EXPERTS,
    gguf_config,
    hf_tensor_name,
)
from jaxserve.model.weights import expert_param_path
from jaxserve.runtime import mxfp4, quant_params, weight_formats

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
    28: ("F64", 1, 8), 30: ("BF16", 1, 2), 39: ("MXFP4", 32, 17),
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


# The last file's parsed header, keyed by the file's identity: start-up reads one file's header three
# times (default_format's inspection, load_gguf, the tokenizer), so it is parsed once; the engine
# drops it (forget_header) once built. The values are shared: callers must not change them.
_HEADER: dict[tuple, tuple[dict[str, Any], dict[str, "TensorInfo"]]] = {}


def forget_header() -> None:
    _HEADER.clear()


class GGUFFile:
    """A parsed GGUF header: `.metadata` (dict), `.tensors` (name -> TensorInfo), `.data` (memmap)."""

    def __init__(self, path: os.PathLike | str):
        self.path = str(path)
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
            st = os.stat(self.path)
        except (OSError, ValueError) as e:
            raise UserError(f"Cannot read GGUF file {self.path}: {e}") from None
        key = (os.path.realpath(self.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        header = _HEADER.get(key)
        if header is None:
            header = self._parse()
            _HEADER.clear()
            _HEADER[key] = header
        self.metadata, self.tensors = header

    def _parse(self) -> tuple[dict[str, Any], dict[str, "TensorInfo"]]:
        buf = self.data
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise UserError(f"{self.path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version = int(buf[4:8].view("<u4")[0])
        if version < 2:
            raise UserError(f"{self.path}: GGUF version {version} is not supported (need >= 2)")
        n_tensors, n_kv = (int(x) for x in buf[8:24].view("<u8"))
        self._raw = memoryview(buf)
        pos = 24
        metadata: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key, pos = self._string(pos)
                vtype = struct.unpack_from("<I", self._raw, pos)[0]
                value, pos = self._value(pos + 4, vtype)
                metadata[key] = value
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
        finally:
            del self._raw
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = (pos + align - 1) // align * align
        tensors: dict[str, TensorInfo] = {}
        for name, gtype, shape, off in infos:
            n = int(np.prod(shape, dtype=np.int64))
            _, blk, bb = GGML_TYPES.get(gtype, (None, 1, 0))
            tensors[name] = TensorInfo(name, gtype, shape, start + off, n // blk * bb)
        return metadata, tensors

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
            if itype == _STRING:  # vocabularies, merges: tens of thousands of strings
                raw, unpack, out = self._raw, struct.Struct("<Q").unpack_from, []
                for _ in range(count):
                    n = unpack(raw, pos)[0]
                    out.append(bytes(raw[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
                    pos += 8 + n
                return out, pos
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


DEQUANTIZE_BYTES = 1 << 20  # raw bytes dequantized per numpy call


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
    else:  # gguf's block formulas over groups of rows large enough to leave the GIL (gguf's own
        # dequantize takes 16 rows a call: Python-bound, and the same values bit for bit)
        q = gguf.quants._type_traits[gguf.GGMLQuantizationType(ggml_type)]
        q.init_grid()
        rows = raw.reshape(-1, raw.shape[-1])
        step = max(1, DEQUANTIZE_BYTES // max(1, rows.shape[1]))
        out = np.concatenate([q.dequantize_rows(rows[i:i + step]).reshape(-1) for i in range(0, len(rows), step)])
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on q/k rows (n_head = heads of this proj)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


KEPT_TYPES = weight_formats.GGUF_KEPT_TYPES  # block types `keep_quantized` holds as stored


def kept_quantized(g: GGUFFile, info: TensorInfo, qk_heads: int | None):
    """Tensor `info` in its quantized format (runtime/weight_formats.py: the [in, out] kernel's panels), or
    None where it is dequantized instead (another type, or a shape without whole panels).
    qk_heads: the heads of a llama-permuted q/k projection, whose rows are put back in order."""
    if info.type_name not in KEPT_TYPES or len(info.shape) != 2 or not weight_formats.quantizable(
            info.shape[::-1], weight_formats.block_of(info.type_name)):
        return None
    raw = g.raw(info)  # (out rows, bytes per row): a permutation of rows applies to it as is
    return weight_formats.from_gguf(raw if qk_heads is None else unpermute_qk(raw, qk_heads), info.type_name)


def load_gguf(path: os.PathLike | str, keep_quantized: bool = False, kernel_dtype=None) -> tuple[dict, dict[str, Any]]:
    """(HF-style config dict, {HF tensor name: float32 ndarray in HF shape}) for a GGUF model file.
    With `keep_quantized`, 2-D tensors of a KEPT_TYPES type stay in their blocks instead, as the
    quantized format of their [in, out] kernel (no float copy is made of them), and stacked experts
    of those types as one ExpertStack under expert 0's name (model/weights.py places it whole);
    other stacked experts are dequantized and split into per-expert views."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"GGUF file not found: {path}")
    g = GGUFFile(path)
    cfg = gguf_config(g)
    arch = g.metadata["general.architecture"]
    for info in g.tensors.values():  # fail before any work on an unsupported type
        if info.ggml_type not in GGML_TYPES:
            g.raw(info)
    weights: dict[str, Any] = {}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the float tensors dequantize on the CPU's cores
        for name, info in g.tensors.items():
            try:
                hf = hf_tensor_name(name, arch)
            except KeyError:
                raise UserError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}") from None
            if hf is None:
                continue
            if EXPERT in hf:
                weights |= _split_experts(g, info, hf, cfg, keep_quantized)
                continue
            if arch in WHOLE_EXPERTS and name.endswith("_exps.weight"):
                weights[hf] = _whole_experts(g, info, cfg)
                continue
            heads = None
            if arch in PERMUTED_QK and ".attn_q." in name:
                heads = cfg["num_attention_heads"]
            elif arch in PERMUTED_QK and ".attn_k." in name:
                heads = cfg["num_key_value_heads"]
            if keep_quantized and (kept := kept_quantized(g, info, heads)) is not None:
                weights[hf] = kept
                continue
            cast = kernel_dtype if kernel_dtype is not None and _packed(hf, cfg["model_type"]) else None
            weights[hf] = pool.submit(_float_tensor, g, name, arch, heads, cast)
    weights = {k: w.result() if isinstance(w, Future) else w for k, w in weights.items()}
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in weights]
    if missing:
        raise UserError(f"{path}: missing tensors {missing}")
    return cfg, weights


def _packed(hf: str, model_type: str) -> bool:
    """Whether HF tensor `hf` is one a weight format packs (quant_params.packs), not an expert's."""
    found = expert_param_path(hf, model_type)
    return found is not None and found[1] is None and quant_params.packs(found[0])


def _float_tensor(g: GGUFFile, name: str, arch: str, heads: int | None, cast=None) -> np.ndarray:
    """Tensor `name` dequantized to float32 in HF's layout; in dtype `cast` where given (load_gguf's
    kernel_dtype) and its [in, out] kernel has a packed layout."""
    w = g.dequantize(name)
    if heads is not None:
        w = unpermute_qk(w, heads)
    elif arch in NORM_SHIFT and name.endswith("norm.weight"):
        w = w - np.float32(1.0)
    elif name.endswith(".ffn_gate_inp_shexp.weight"):
        w = w.reshape(1, -1)  # HF's [1, hidden] (llama.cpp may store it 1-D)
    if cast is not None and weight_formats.quantizable(w.shape[::-1], weight_formats.block_of("bfloat16")):
        w = w.astype(cast)
    return w


def _whole_experts(g: GGUFFile, info: TensorInfo, cfg: dict):
    """gpt-oss's stacked experts [E, out, in] under one name: MXFP4 kept packed in HF's block layout
    (runtime/mxfp4.py), any other type dequantized to [E, in, out] (HF's float gpt-oss layout)."""
    n = cfg.get("num_local_experts", 0)
    if len(info.shape) != 3 or info.shape[0] != n:
        raise UserError(f"{g.path}: expert tensor {info.name!r} has shape {list(info.shape)}, expected "
                        f"[{n} (expert_count), out, in]: the file is inconsistent.", param="model")
    if info.ggml_type == MXFP4_TYPE:
        return mxfp4.from_ggml(g.raw(info))
    return np.ascontiguousarray(g.dequantize(info.name).swapaxes(-1, -2))


def _split_experts(g: GGUFFile, info: TensorInfo, template: str, cfg: dict, keep_quantized: bool = False) -> dict:
    """A stacked expert tensor [E, out, in], dequantized, as E per-expert [out, in] views; with
    `keep_quantized` and a kept type, its blocks as stored, one ExpertStack under expert 0's name."""
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if len(info.shape) != 3 or info.shape[0] != n:
        raise UserError(f"{g.path}: expert tensor {info.name!r} has shape {list(info.shape)}, expected "
                        f"[{n} (expert_count), out, in]: the file is inconsistent.", param="model")
    if keep_quantized and info.type_name in KEPT_TYPES and weight_formats.quantizable(
            info.shape[:0:-1], weight_formats.block_of(info.type_name)):
        raw = g.raw(info).reshape(n, info.shape[1], -1)  # [E, out rows, bytes per row]
        stack = weight_formats.stack_experts([weight_formats.from_gguf(raw[e], info.type_name) for e in range(n)])
        return {template.replace(EXPERT, "0"): stack}
    w = g.dequantize(info.name)
    return {template.replace(EXPERT, str(e)): w[e] for e in range(n)}
