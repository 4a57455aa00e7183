"""`jaxserve convert SRC DST`: an HF directory, a .gguf file or the default model written as a
self-contained Orbax checkpoint directory (its layout, and how it is read back: model/orbax_io.py),
with the tokenizer's files beside the weights."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxserve.errors import UserError
from jaxserve.model import sharding
from jaxserve.model.config import ModelConfig
from jaxserve.model.gguf_loader import load_gguf
from jaxserve.model.loader import _load_hf_dir, resolve_model_path
from jaxserve.model.orbax_io import FORMAT, MARKER, PARAMS_DIR, VERSION, WEIGHT_SUFFIXES, is_orbax_dir
from jaxserve.model.weights import hf_to_params
from jaxserve.runtime import mesh as meshlib
from jaxserve.tokenizer import Tokenizer


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield "/".join(prefix + (k,)), v


def _save_tree(params: dict, dst: Path, cfg) -> int:
    """Save sharded: lay the tree out over the local devices (largest valid TP size) and let Orbax
    write each shard once. Returns the TP size used."""
    n = jax.local_device_count()
    tp = max(t for t in sharding.valid_tp_sizes(cfg, n) if n % t == 0)
    mesh = meshlib.make_mesh(tp, devices=jax.local_devices())
    shapes = meshlib.shape_tree(params)
    arrays = meshlib.place_host_params(params, sharding.checkpoint_shardings(shapes, cfg, mesh), np.float32)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((dst / PARAMS_DIR).resolve(), arrays)
        ckptr.wait_until_finished()
    return tp


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _gguf_tokenizer(src: Path, dst: Path) -> list[str]:
    tok = Tokenizer.from_gguf(src)
    files = list(tok.hf.save_pretrained(str(dst)))
    gen = {"eos_token_id": sorted(tok.eos_token_ids)}
    if tok.bos_token_id is not None:
        gen["bos_token_id"] = tok.bos_token_id
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return sorted({Path(f).name for f in files} | {"generation_config.json"})


def convert_model(src, dst) -> dict:
    """Convert an HF directory, a .gguf file or the default model (None / "default") to an Orbax
    checkpoint directory at `dst`. Returns a summary dict."""
    t0 = time.perf_counter()
    src_path = resolve_model_path(None if src in (None, "default") else str(src))
    dst = Path(dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"The destination {str(dst)!r} already exists and is not empty: choose a new directory.")
    if is_orbax_dir(src_path):
        raise UserError(f"{str(src_path)!r} is already a jaxserve Orbax checkpoint.")
    if src_path.is_file() and src_path.suffix == ".gguf":
        hf_config, weights = load_gguf(src_path)
        kind = "gguf"
    elif src_path.is_dir():
        hf_config, weights, _ = _load_hf_dir(src_path)
        kind = "hf"
    else:
        raise UserError(f"Cannot convert {str(src_path)!r}: expected an HF model directory or a .gguf file.")
    cfg = ModelConfig.from_hf(hf_config, source=str(src_path))
    if cfg.expert_format is not None:
        raise UserError(f"{str(src_path)!r} keeps its experts in {cfg.expert_format.upper()}, which `jaxserve convert` "
                        "cannot write yet: serve the Hugging Face directory directly.", param="model")
    params = hf_to_params(weights, cfg, dtype=np.float32)
    del weights
    t_read = time.perf_counter() - t0

    dst.mkdir(parents=True, exist_ok=True)
    try:
        files = _copy_tokenizer_files(src_path, dst) if kind == "hf" else _gguf_tokenizer(src_path, dst)
        if kind == "gguf":
            (dst / "config.json").write_text(json.dumps(hf_config, indent=2, default=_json_default) + "\n")
        tp = _save_tree(params, dst, cfg)
        meta = {
            "format": FORMAT, "version": VERSION, "source": str(src_path), "source_kind": kind,
            "dtype": "float32", "saved_tensor_parallel_size": tp,
            "params": {name: list(np.shape(w)) for name, w in _flat(params)},
        }
        (dst / MARKER).write_text(json.dumps(meta, indent=1) + "\n")  # written last: marks completion
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    nbytes = sum(int(np.asarray(w).nbytes) for _, w in _flat(params))
    return dict(src=str(src_path), dst=str(dst), kind=kind, arrays=len(meta["params"]), bytes=nbytes,
                files=files, read_seconds=t_read, seconds=time.perf_counter() - t0, tensor_parallel_size=tp)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def convert(args) -> int:
    """`jaxserve convert SRC DST` (SRC: HF dir, .gguf file, or `default`)."""
    s = convert_model(args.src, args.dst)
    print(f"Converted {s['src']} ({s['kind']}) -> {s['dst']}: {s['arrays']} arrays, "
          f"{s['bytes'] / 2**20:.1f} MiB float32, tokenizer files {', '.join(s['files'])} "
          f"in {s['seconds']:.1f}s (read {s['read_seconds']:.1f}s).")
    return 0
