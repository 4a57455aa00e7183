"""`jaxserve bench expert_bytes`: the routed experts' bytes per device under tensor and expert
parallelism, from shapes only (no weights, no devices), through the engine's own code: the stacks
made by `quant_params.quantize_params` (ShapeDtypeStructs), padded by `expert_padding.pad_expert_stacks`,
split by `sharded_ops.weight_spec` on an abstract mesh. Before issue 27's packed-experts-under-TP
change the runner held experts in a weight format as float only at tensor parallel size 1; under
TP / EP they were float (`--dtype`, bfloat16 on GPU / TPU): the `float` row.

    jaxserve bench expert_bytes [--model configs/models/qwen3-30b-a3b.json] [--tp 8]
        [--formats float,q4_k+q6_k,q4_k,q8_0,w8a8,w4a8]

A format `a+b` is a for gate / up and b for down (Q4_K_M's mix: Q4_K gate / up, Q6_K down).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MiB, GiB = 1 << 20, 1 << 30


def layer_bytes_per_device(cfg, formats: str, tp: int, expert_parallel: bool, dtype=jnp.bfloat16) -> tuple[int, int]:
    """(bytes of one MoE layer's routed experts on one device, the padded intermediate size)."""
    from jaxserve.model import expert_padding
    from jaxserve.runtime import mesh as meshlib
    from jaxserve.runtime.quant_params import quantize_params
    from jaxserve.runtime.sharded_ops import weight_spec

    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate_proj": (e, h, i), "up_proj": (e, h, i), "down_proj": (e, i, h)}
    experts = {n: jax.ShapeDtypeStruct(s, dtype) for n, s in shapes.items()}
    if formats != "float":
        gate_up, _, down = formats.partition("+")
        gu = {n: experts[n] for n in ("gate_proj", "up_proj")}
        experts = {**quantize_params({"experts": gu}, gate_up)["experts"],
                   **quantize_params({"experts": {"down_proj": experts["down_proj"]}}, down or gate_up)["experts"]}
    one = dataclasses.replace(cfg, num_layers=1, moe_layers=(0,), expert_parallel=expert_parallel)
    experts = expert_padding.pad_expert_stacks({"layers_0": {"mlp": {"experts": experts}}}, one, tp)["layers_0"]["mlp"][
        "experts"]
    mesh = jax.sharding.AbstractMesh((1, tp), (meshlib.DATA, meshlib.MODEL))
    total = 0
    for name, w in experts.items():
        spec = weight_spec(w, name == "down_proj", expert_parallel)
        specs = jax.tree.leaves(jax.tree.map(lambda _: spec, w) if isinstance(spec, jax.sharding.PartitionSpec)
                                else spec, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        for a, s in zip(jax.tree.leaves(w), specs):
            shard = jax.sharding.NamedSharding(mesh, s).shard_shape(a.shape)
            total += int(np.prod(shard)) * np.dtype(a.dtype).itemsize
    return total, experts["down_proj"].shape[1]


def main(argv: list[str] | None = None) -> int:
    from jaxserve.worker.lower import load_model_config

    p = argparse.ArgumentParser(prog="jaxserve bench expert_bytes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="configs/models/qwen3-30b-a3b.json")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--formats", default="float,q4_k+q6_k,q4_k,q8_0,w8a8,w4a8")
    args = p.parse_args(argv)
    cfg = load_model_config(args.model)
    layers = len(cfg.moe_layers)
    print(f"{args.model}: {layers} MoE layers of {cfg.num_experts} experts [{cfg.hidden_size} x "
          f"{cfg.moe_intermediate_size}], routed experts' bytes per device at {args.tp} devices")
    print("| experts | TP (intermediate split) | EP (whole experts) |")
    print("|---|--:|--:|")
    for formats in args.formats.split(","):
        cells = []
        for ep in (False, True):
            per_layer, padded = layer_bytes_per_device(cfg, formats, args.tp, ep)
            pad = f", I {cfg.moe_intermediate_size} -> {padded}" if padded != cfg.moe_intermediate_size else ""
            cells.append(f"{per_layer * layers / GiB:.2f} GiB ({per_layer / MiB:.1f} MiB a layer{pad})")
        name = "float (bfloat16)" if formats == "float" else formats
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
