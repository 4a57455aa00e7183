"""Find and load a model: an HF directory (safetensors), a GGUF file, or the embedded default.

Returns host-side numpy weights in the Flax tree layout; the runner places them on devices. An
Orbax directory (`jaxserve convert` output) is returned unread, for the runner to restore onto the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.errors import MissingFileError, UserError
from jaxserve.model.config import ModelConfig
from jaxserve.model.default_model import default_model_path
from jaxserve.model.orbax_io import open_orbax
from jaxserve.model.weights import hf_to_params
from jaxserve.runtime import panels, weight_formats


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    params: dict  # numpy tree, or a lazy OrbaxCheckpoint (restored by the runner)
    generation_defaults: dict = field(default_factory=dict)
    load_seconds: float = 0.0


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def resolve_model_path(model: str | None) -> Path:
    if model is None or model in ("default", "SmolLM2-135M-Instruct"):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise MissingFileError(
            f"Model path {str(path)!r} does not exist. Pass a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file; omit --model for the embedded default."
        )
    return path


def load_model(model: str | None, dtype=None, quantization: str | None = None) -> LoadedModel:
    """dtype: the host weights' float dtype; None keeps each as the checkpoint stores it (a bfloat16
    checkpoint stays bfloat16 on the host: the runner casts each shard to its compute dtype as it
    places it, so no float32 copy of the whole model is ever held). quantization "gguf": keep a
    GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices in their blocks (runtime/weight_formats.py); "w4a8"
    keeps them too, and quant_params.quantize_params lays the 4-bit ones out for int8 activations."""
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    params = None
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if quantization == "gguf" and not is_gguf:
        raise UserError(f"quantization='gguf' keeps a GGUF file's blocks, but {str(path)!r} is not a .gguf file: "
                        "use int8, q8_0, q4_0 or q4_1 for other checkpoints.", param="quantization")
    if is_gguf:
        from jaxserve.model.gguf_loader import load_gguf  # gguf: not on every image (tools/device_check)

        # bfloat16: the kernels the runner packs are cast as they are dequantized (gguf_loader.py)
        hf_config, weights = load_gguf(path, keep_quantized=quantization in ("gguf", "w4a8"),
                                       kernel_dtype=ml_dtypes.bfloat16 if quantization == "bfloat16" else None)
        gen = {}
    elif path.is_dir() and (path / "jaxserve_orbax.json").is_file():  # `jaxserve convert` output
        hf_config, params, gen = open_orbax(path)  # lazy: the runner restores it onto the mesh
    elif path.is_dir():
        hf_config, weights, gen = _load_hf_dir(path, keep_fp8=quantization == "fp8")
    else:
        raise UserError(
            f"Cannot load {str(path)!r}: expected a directory with config.json and *.safetensors, "
            "or a .gguf file."
        )
    cfg = ModelConfig.from_hf(hf_config, source=str(path))
    if params is None:
        params = hf_to_params(weights, cfg, dtype=dtype)
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
        cfg = _replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + eos)))
    name = "SmolLM2-135M-Instruct" if model in (None, "default") else (model or path.name)
    return LoadedModel(
        name=name,
        path=path,
        config=cfg,
        params=params,
        generation_defaults={k: gen[k] for k in GENERATION_KEYS if gen.get(k) is not None},
        load_seconds=time.perf_counter() - t0,
    )


def release_header(path: Path) -> None:
    """A GGUF's parsed header is kept for its readers at start-up (the default format, the loader,
    the tokenizer): let it go once they are done."""
    if path.suffix == ".gguf":
        from jaxserve.model.gguf_loader import forget_header

        forget_header()


def _replace(cfg: ModelConfig, **kw) -> ModelConfig:
    return dataclasses.replace(cfg, **kw)


def _load_hf_dir(path: Path, keep_fp8: bool = False) -> tuple[dict, dict, dict]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise MissingFileError(f"{str(path)!r} has no config.json: it is not a Hugging Face model directory.")
    hf_config = json.loads(cfg_file.read_text())
    check_checkpoint_quantization(hf_config, path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise MissingFileError(
            f"No *.safetensors weights in {str(path)!r}. Only safetensors checkpoints are supported "
            "(convert PyTorch .bin files with `transformers` first)."
        )
    weights = {}
    for f in files:
        weights.update(_read_safetensors(path / f))
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size")
    weights = fold_weight_scales(weights, block, keep_fp8)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    return hf_config, weights, gen


# config.json's quantization_config that load as their float values (fold_weight_scales): HF fp8,
# and compressed-tensors' float8 / int8 weights with scales; gpt-oss's MXFP4 experts stay packed
# (model/families/gpt_oss.py, runtime/mxfp4.py). Packed int4 (AWQ, GPTQ, compressed-tensors
# pack-quantized) and other methods are refused by name.
CHECKPOINT_QUANT = {"fp8": None, "mxfp4": None,
                    "compressed-tensors": (None, "float-quantized", "int-quantized", "naive-quantized")}


def check_checkpoint_quantization(hf_config: dict, path: Path) -> None:
    """A UserError naming a checkpoint quantization this loader cannot read."""
    qc = hf_config.get("quantization_config") or {}
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method is None or (method in CHECKPOINT_QUANT and (CHECKPOINT_QUANT[method] is None or
                                                         fmt in CHECKPOINT_QUANT[method])):
        return
    what = f"{method!r}" + (f" ({fmt})" if fmt else "")
    raise UserError(f"{str(path)!r} holds {what}-quantized weights (config.json quantization_config), which "
                    "jaxserve cannot load: use the float or FP8 checkpoint (--quantization int8, w8a8, w4a8 or "
                    "q4_k quantize it at load), or a GGUF file.", param="model")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    if not file.exists():
        raise MissingFileError(f"Weight file {str(file)!r} named in the index is missing.")
    out = {}
    fp8 = _fp8_tensors(file)  # safetensors' flax reader has no float8 (numpy lacks the dtype)
    with safe_open(str(file), framework="flax") as f:  # flax: handles bfloat16 too
        for name in f.keys():
            if name not in fp8:
                out[name] = np.asarray(f.get_tensor(name))  # as stored (uint8: MXFP4 blocks / scales)
    return out | fp8


def _fp8_tensors(file: Path) -> dict[str, np.ndarray]:
    """The file's float8 tensors (ml_dtypes arrays), read from the safetensors layout directly (u64 header
    size, JSON header of dtype / shape / data_offsets, then the data)."""
    kinds = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    data = np.memmap(file, dtype=np.uint8, mode="r")
    size = int(data[:8].view("<u8")[0])
    header = json.loads(bytes(data[8:8 + size]))
    out = {}
    for name, t in header.items():
        if name != "__metadata__" and t["dtype"] in kinds:
            lo, hi = (8 + size + o for o in t["data_offsets"])
            out[name] = data[lo:hi].view(kinds[t["dtype"]]).reshape(t["shape"])  # float8 (fold_weight_scales)
    return out


# Host dtypes a tensor keeps as loaded (the runner casts per shard); others (float8) become float32.
KEPT_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def fold_weight_scales(weights: dict[str, np.ndarray], block: list[int] | None = None,
                       keep_fp8: bool = False) -> dict:
    """FP8 (and other scaled) checkpoints -> float weights: `X.weight` times `X.weight_scale`
    (compressed-tensors: per tensor [] / [1], or per output channel [N] / [N, 1]) or times
    `X.weight_scale_inv` (HF's fp8 layout: one scale per `block` = [bn, bk] tile, default 128 x 128).
    Activation scales (`input_scale`) are dropped: activations are not quantized here. With
    `keep_fp8`, float8_e4m3fn matrices with per-tensor / per-channel scales stay as they are stored
    (runtime/weight_formats.py's Fp8Weight of their [in, out] kernel)."""
    out = {}
    for name, w in weights.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        scale = weights.get(f"{name}_scale", weights.get(f"{name}_scale_inv"))
        if scale is None or not name.endswith(".weight"):
            out[name] = w if w.dtype in KEPT_DTYPES else np.asarray(w, np.float32)  # float8 -> float32
            continue
        if keep_fp8 and (kept := _kept_fp8(w, scale)) is not None:
            out[name] = kept
            continue
        w = np.asarray(w, np.float32)
        if f"{name}_scale_inv" in weights and scale.ndim == 2 and scale.shape[0] != w.shape[0]:  # blocks
            bn, bk = block or (128, 128)
            scale = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[: w.shape[0], : w.shape[1]]
        elif scale.ndim == 1 and scale.size == w.shape[0] and w.ndim == 2:
            scale = scale[:, None]
        if np.broadcast_shapes(scale.shape, w.shape) != w.shape:
            raise UserError(f"Weight {name!r} {w.shape} has a scale of shape {scale.shape} this loader does not "
                            "read: supported are per-tensor, per-output-channel and 2-D block scales.",
                            param="model")
        out[name] = (w * scale).astype(np.float32)
    return out


def _kept_fp8(w: np.ndarray, scale: np.ndarray):
    """An e4m3 [N, K] matrix with one scale or one per output channel as an Fp8Weight, else None."""
    if w.dtype != ml_dtypes.float8_e4m3fn or w.ndim != 2 or not weight_formats.quantizable(w.shape[::-1]):
        return None
    if scale.size not in (1, w.shape[0]):
        return None
    per_channel = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (w.shape[0],))
    return weight_formats.Fp8Weight(np.ascontiguousarray(panels.to_panels(w.view(np.uint8).T)),
                           np.ascontiguousarray(per_channel))
