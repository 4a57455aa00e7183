"""Orbax checkpoints: the directory `jaxserve convert SRC DST` writes (jaxserve/convert.py), restored
straight onto the device mesh.

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

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import MissingFileError, UserError
from jaxserve.runtime.mesh import make_mesh, replicated

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
        import orbax.checkpoint as ocp  # heavy (tensorstore): only where a converted model is restored

        def abstract(shape, sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        target = jax.tree.map(abstract, self.shapes(), shardings, is_leaf=lambda x: isinstance(x, tuple))
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore((self.path / PARAMS_DIR).resolve(), target)

    def load_numpy(self) -> dict:
        """The whole tree as host numpy arrays (tests, tools)."""
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
