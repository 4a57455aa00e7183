"""Tensor parallelism by JAX sharding: the device mesh, and the arrays placed on it.

A `Mesh` with axes ("data", "model"). Where each model parameter goes on the model axis (the
Megatron-style layout, kv-head replication, experts, quantized panels) is the model's knowledge and
lives in `jaxserve/model/sharding.py`; this module holds what knows no parameter names:

  KV cache    [blocks, bs, Hkv, D]  on kv heads       P(None, None, "model", None)

Weights are placed shard by shard: each device receives only its slice of the host array
(`jax.make_array_from_callback`), never a full copy (`place_host_params`). `map_paths` builds a tree
of the same nesting from a function of each leaf's path; `to_global` / `to_host` move a step's
inputs and outputs between host numpy and (multi-process) global arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.errors import UserError
from pallas_kernels.kv_quant import QuantPages

DATA, MODEL = "data", "model"


# ---- the mesh ---------------------------------------------------------------------------------
def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp visible devices (all processes' devices)."""
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    if tp < 1 or dp < 1:
        raise UserError(f"Invalid mesh size data={dp}, model={tp}: both must be >= 1.")
    devices = list(jax.devices() if devices is None else devices)
    need = tp * dp
    if need > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f" On CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                    "to split the host into that many devices.")
        what = f"tensor_parallel_size={tp}" + (f" x data_parallel_size={dp}" if dp > 1 else "")
        raise UserError(
            f"{what} needs {need} devices, but only "
            f"{len(devices)} {devices[0].platform if devices else ''} device(s) are visible.{hint}"
        )
    if jax.process_count() > 1 and need != len(devices):
        raise UserError(
            f"Multi-host runs need the mesh to cover every device: {need} requested, "
            f"{len(devices)} devices over {jax.process_count()} processes."
        )
    devs = devices[:need]
    try:
        grid = mesh_utils.create_device_mesh((dp, tp), devices=devs)
    except Exception:  # noqa: BLE001 - topology-unaware fallback (e.g. CPU subsets)
        grid = np.array(devs).reshape(dp, tp)
    return Mesh(grid, (DATA, MODEL))


def tp_size(mesh: Mesh) -> int:
    return int(mesh.shape[MODEL])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _paths(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def map_paths(tree, fn):
    """A nested dict like `tree` with `fn(path, leaf)` at each leaf (path: the tuple of keys)."""
    out: dict = {}
    for path, leaf in _paths(tree):
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = fn(path, leaf)
    return out


def shape_tree(params) -> dict:
    """{path: shape} tree of a numpy / jax / ShapeDtypeStruct tree."""
    return map_paths(params, lambda _p, w: tuple(w.shape))


def kv_cache_sharding(mesh: Mesh, layout: str = "paged", quantized: bool = False):
    """One layer's KV array's sharding: kv heads over "model"; quantized pages' scales
    ([nb, bs, Hkv]) go with their heads (a kv_quant.QuantPages of two shardings)."""
    spec = page_spec(layout, quantized) if tp_size(mesh) > 1 else (QuantPages(P(), P()) if quantized else P())
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda x: isinstance(x, P))


def page_spec(layout: str = "paged", quantized: bool = False):
    """Where a layer's KV array splits over the model axis: its kv heads (dim 2 of paged
    [nb, bs, Hkv, D], dim 1 of tpu-fused [nb, 2*Hkv, bs, Dp]); for quantized pages a QuantPages
    of the data's and the scales' specs (scales [nb, bs, Hkv], tpu-fused [nb, 2*Hkv, bs])."""
    if layout == "tpu-fused":
        pages = P(None, MODEL, None, None)
        return QuantPages(pages, P(None, MODEL, None)) if quantized else pages
    pages = P(None, None, MODEL, None)
    return QuantPages(pages, P(None, None, MODEL)) if quantized else pages


# ---- placing weights --------------------------------------------------------------------------
def place_host_params(host: dict, shardings: dict, dtype) -> dict:
    """numpy tree -> jax arrays laid out by `shardings`, each device receiving only its slice."""
    dtype = jnp.dtype(dtype)

    def put(path, w):
        node = shardings
        for k in path:
            node = node[k]
        w = np.asarray(w)
        return jax.make_array_from_callback(w.shape, node, lambda idx: np.asarray(w[idx], dtype=dtype))

    return map_paths(host, put)


def bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s shards it holds}, from the arrays' shardings."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ---- host <-> global arrays (multi-process) ---------------------------------------------------
def to_global(tree, sharding: NamedSharding):
    """Host numpy leaves -> arrays with `sharding` (identical host data on every process).

    In one process jit accepts numpy directly; with several processes the inputs of a step must be
    global arrays, built here from each process's (identical) copy."""
    if jax.process_count() == 1:
        return tree

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree)


def to_host(x) -> np.ndarray:
    """A replicated (possibly multi-process) array -> numpy, from the local copy."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))
