"""Orbax checkpoints: `jaxserve convert SRC DST` and restoring straight onto the device mesh.

A converted model is a self-contained directory:

    DST/jaxserve_orbax.json   marker: format, version, source, dtype, every parameter's shape
    DST/config.json           the HF-style model config (from the HF dir, or built from GGUF metadata)
    DST/generation_config.json
    DST/tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   (copied, or from GGUF)
    DST/params/               the Orbax (OCDBT/tensorstore) checkpoint of the Flax param tree

The loader sees the marker and hands the runner a lazy `OrbaxCheckpoint`; the runner restores it
with the target NamedShardings, so each device (each host, in a multi-host run) reads only its own
slices from storage: no host copy of the whole model, no re-layout, no dequantization. That is the
fast start-up path for TPU / GPU VMs.

Weights are stored as the loader produces them (float32), so a round trip is bit-identical; the
runner casts to its compute dtype on restore.
"""

from __future__ import annotations

from jaxserve.errors import MissingFileError, UserError
import json
import shutil
import time
from pathlib import Path

import numpy as np

MARKER = "jaxserve_orbax.json"
FORMAT = "jaxserve-orbax"
VERSION = 1
PARAMS_DIR = "params"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def is_orbax_dir(path) -> bool:
    return Path(path).is_dir() and (Path(path) / MARKER).is_file()


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.is_file() else {}


class OrbaxCheckpoint:
    """A converted model's weights, not yet read: `restore(shardings, dtype)` reads them onto devices."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        self.meta = meta

    def shapes(self) -> dict:
        out: dict = {}
        for name, shape in self.meta["params"].items():
            node = out
            keys = name.split("/")
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = tuple(shape)
        return out

    def restore(self, shardings: dict, dtype) -> dict:
        import jax
        import orbax.checkpoint as ocp

        def abstract(shape, sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        target = jax.tree.map(abstract, self.shapes(), shardings, is_leaf=lambda x: isinstance(x, tuple))
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore((self.path / PARAMS_DIR).resolve(), target)

    def load_numpy(self) -> dict:
        """The whole tree as host numpy arrays (tests, tools)."""
        import jax
        import jax.numpy as jnp

        from jaxserve.runtime.mesh import make_mesh, replicated

        rep = replicated(make_mesh(1))
        tree = self.restore(jax.tree.map(lambda _: rep, self.shapes(), is_leaf=lambda x: isinstance(x, tuple)),
                            jnp.dtype(self.meta.get("dtype", "float32")))
        return jax.tree.map(np.asarray, tree)

    def __repr__(self) -> str:
        return f"OrbaxCheckpoint({str(self.path)!r}, {len(self.meta['params'])} arrays)"


def open_orbax(path) -> tuple[dict, OrbaxCheckpoint, dict]:
    """(HF-style config dict, lazy checkpoint, generation config) of a converted directory."""
    path = Path(path)
    meta = _read_json(path / MARKER)
    if meta.get("format") != FORMAT or int(meta.get("version", 0)) > VERSION:
        raise UserError(f"{str(path)!r} is not a jaxserve Orbax checkpoint this version can read "
                         f"(marker {MARKER}: {meta.get('format')!r} v{meta.get('version')}).")
    if not (path / "config.json").is_file() or not (path / PARAMS_DIR).is_dir():
        raise MissingFileError(f"{str(path)!r} is incomplete: config.json or {PARAMS_DIR}/ is missing; "
                                "run `jaxserve convert` again.")
    return _read_json(path / "config.json"), OrbaxCheckpoint(path, meta), _read_json(path / "generation_config.json")


# ---- conversion -------------------------------------------------------------------------------
def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield "/".join(prefix + (k,)), v


def _save_tree(params: dict, dst: Path, cfg) -> int:
    """Save sharded: lay the tree out over the local devices (largest valid TP size) and let Orbax
    write each shard once. Returns the TP size used."""
    import jax
    import orbax.checkpoint as ocp

    from jaxserve.runtime import mesh as meshlib

    n = jax.local_device_count()
    tp = max(t for t in meshlib.valid_tp_sizes(cfg, n) if n % t == 0)
    mesh = meshlib.make_mesh(tp, devices=jax.local_devices())
    shapes = meshlib.shape_tree(params)
    arrays = meshlib.place_host_params(params, meshlib.checkpoint_shardings(shapes, cfg, mesh), np.float32)
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
    from jaxserve.tokenizer import Tokenizer

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
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.loader import _load_hf_dir, resolve_model_path
    from jaxserve.model.weights import hf_to_params

    t0 = time.perf_counter()
    src_path = resolve_model_path(None if src in (None, "default") else str(src))
    dst = Path(dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"The destination {str(dst)!r} already exists and is not empty: choose a new directory.")
    if is_orbax_dir(src_path):
        raise UserError(f"{str(src_path)!r} is already a jaxserve Orbax checkpoint.")
    if src_path.is_file() and src_path.suffix == ".gguf":
        from jaxserve.model.gguf_loader import load_gguf

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
