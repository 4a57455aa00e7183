"""A model's weights placed on the runner's mesh (worker/runner.py): quantized at load where a
`--quantization` format asks for it, routed experts padded for tensor parallelism
(model/expert_padding.py), k/v heads repeated where TP exceeds the kv heads, and each leaf laid
out in model/sharding.py's layout in the compute dtype. Lazy checkpoints (Orbax) restore straight
into that layout."""

from __future__ import annotations

from jaxserve.model import expert_padding, sharding
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import mesh as meshlib
from jaxserve.runtime import quant_params


def place_params(params, source: ModelConfig, sharded: ModelConfig, mesh, quantization: str | None, dtype,
                 kv_repeat: int) -> tuple[dict, object]:
    """(params on the mesh, their shardings) for `source`'s host params (or a lazy checkpoint);
    `sharded` is source's per-device config (sharding.sharded_config)."""
    quantize = quantization not in (None, "gguf")
    if quantize and hasattr(params, "restore"):  # a lazy checkpoint: quantized once restored
        params = params.restore(sharding.checkpoint_shardings(params.shapes(), source, mesh), dtype)
    tp = meshlib.tp_size(mesh)
    if quantize:  # routed experts kept in a weight format (runtime/expert_matmul.py), sharded as stored
        params = quant_params.quantize_params(params, quantization)
    params = expert_padding.pad_packed_experts(params, source, sharded, tp)  # under TP: whole blocks per device
    if quant_params.has_quantized(params):  # each part sharded like its float kernel (mesh.py), floats in dtype
        params = sharding.repeat_kv_heads(params, source, kv_repeat)
        shardings = sharding.quantized_shardings(params, source, mesh)
        return quant_params.place_params(params, dtype, shardings), shardings
    if hasattr(params, "restore"):  # lazy checkpoint: restore straight into the target layout
        shapes = params.shapes()
        params = params.restore(sharding.checkpoint_shardings(shapes, source, mesh), dtype)
    else:
        shapes = meshlib.shape_tree(params)
        params = meshlib.place_host_params(params, sharding.checkpoint_shardings(shapes, source, mesh), dtype)
    shardings = sharding.param_shardings(sharding.expanded_shapes(shapes, source, kv_repeat), source, mesh)
    return sharding.expand_kv_heads(params, source, kv_repeat, shardings), shardings
