"""`jaxserve lower`: the engine's whole step exported for cuda and tpu from a config.json alone.

Lowering runs the Pallas -> Mosaic GPU / Mosaic TPU lowering and XLA's SPMD annotations in full
(an abstract mesh stands in for the devices); it does not run the target's compilers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import pytest

from jaxserve import cli
from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.runtime import compat, memory
from jaxserve.runtime import mesh as meshlib
from jaxserve.runtime import kv_sizing
from jaxserve.runtime.backend import resolve_backend
from jaxserve.errors import UserError
from jaxserve.worker import runner as rt
from jaxserve.worker.lower import AbstractCheckpoint, AbstractRunner, cut_layers, load_model_config, prepare

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
             tie_word_embeddings=False, torch_dtype="bfloat16")
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32)
# A decode-wide step, a one-sequence prefill and a step with logit adjustments (penalties/bias).
KEYS = [BucketKey(8, 8, 0), BucketKey(32, 1, 0), BucketKey(16, 8, 512)]
KERNEL = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}
# Pallas calls per layer: attention on cuda (XLA writes KV); the KV write and attention on tpu.
CALLS_PER_LAYER = {"cuda": 1, "tpu": 2}


def _config(tmp_path, **overrides) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return str(tmp_path)


def _param_count(hf: dict) -> int:
    h, i, v, n = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


@pytest.mark.parametrize("platform,tp", [("cuda", 1), ("cuda", 2), ("tpu", 1), ("tpu", 2), ("tpu", 8)])
def test_whole_step_lowers_with_the_pallas_kernels(tmp_path, platform, tp):
    lowering = prepare(_config(tmp_path), platform, EngineConfig(**ENGINE, tensor_parallel_size=tp))
    assert lowering.runner.backend.attention == "pallas"
    assert set(KEYS) <= set(lowering.runner.all_buckets())
    for key in KEYS:
        exported = lowering.export(key)
        assert exported.platforms == (platform,)
        assert exported.nr_devices == tp
        # the KV cache is lowered at the planned size, sharded on kv heads under TP
        k_pages = exported.in_avals[len(jax.tree.leaves(lowering.runner.params))]
        kv_heads = lowering.runner.model_cfg.num_kv_heads  # repeated to one per device at tp 8
        if platform == "tpu":  # tpu-fused: K and V of every kv head, head_dim 64 -> 128 lanes
            assert k_pages.shape == (lowering.plan.num_blocks, 2 * kv_heads, 16, 128)
        else:
            assert k_pages.shape == (lowering.plan.num_blocks, 16, kv_heads, 64)
        step = lowering.lower(key)
        assert step.kernel_calls == CALLS_PER_LAYER[platform] * LLAMA["num_hidden_layers"], step.describe()
        assert step.num_devices == tp


def test_tp8_repeats_kv_heads_and_lowers(tmp_path):
    """8 devices over 2 kv heads: each kv head repeated 4 times, one per device (mesh.py)."""
    lowering = prepare(_config(tmp_path), "cuda", EngineConfig(**ENGINE, tensor_parallel_size=8))
    assert lowering.runner.model_cfg.num_kv_heads == 8
    step = lowering.lower(BucketKey(8, 8, 0))
    assert (step.num_devices, step.kernel_calls) == (8, 2)


def test_gpu_below_sm90_lowers_the_portable_path(tmp_path):
    lowering = prepare(_config(tmp_path), "cuda", EngineConfig(**ENGINE), compute_capability="8.0")
    assert lowering.runner.backend.attention == "xla"
    assert lowering.lower(BucketKey(8, 8, 0)).kernel_calls == 0


def test_the_portable_path_lowers_each_context_width(tmp_path):
    """xla's block table is a bucket dimension: 1024 tokens of 16 = 64 blocks -> widths 16, 32, 64."""
    lowering = prepare(_config(tmp_path, max_position_embeddings=1024), "cuda", EngineConfig(**ENGINE),
                       compute_capability="8.0")
    keys = lowering.runner.all_buckets()
    assert {k.c for k in keys} == {16, 32, 64} and len(keys) == 3 * len({k._replace(c=0) for k in keys})
    for c in (16, 64):
        step = lowering.lower(BucketKey(8, 8, 0, c=c))
        assert step.kernel_calls == 0 and f"C={c} " in step.describe()
        assert f"tensor<8x{c}xi32>" in lowering.export(BucketKey(8, 8, 0, c=c)).mlir_module()


@pytest.mark.parametrize("tp", [1, 2])
def test_memory_plan_from_shapes(tmp_path, tp):
    lowering = prepare(_config(tmp_path), "tpu", EngineConfig(**ENGINE, tensor_parallel_size=tp),
                       device_memory=1 << 30)
    plan, mc = lowering.plan, lowering.model
    total = _param_count(LLAMA) * 2  # bfloat16
    assert lowering.total_weight_bytes == total
    # every matrix splits over tp; norms (3 per layer boundary) stay whole on each device
    h = LLAMA["hidden_size"]
    norms = (2 * LLAMA["num_hidden_layers"] + 1) * h * 2
    assert plan.weight_bytes == (total - norms) // tp + norms
    assert plan.block_bytes == kv_sizing.kv_bytes_per_block(mc, 16, "bfloat16", tp, "tpu-fused")
    # the plan counts what is allocated: head_dim 64 padded to 128 lanes doubles the bytes
    assert plan.block_bytes == 2 * kv_sizing.kv_bytes_per_block(mc, 16, "bfloat16", tp)
    allocated = sum(math.prod(lowering.runner.kv_sharding.shard_shape(a.shape)) * a.dtype.itemsize
                    for a in jax.tree.leaves(lowering.runner.kv.layers))
    assert allocated == plan.kv_bytes == plan.num_blocks * plan.block_bytes
    assert plan.device_limit == 1 << 30 and plan.tensor_parallel_size == tp
    assert plan.num_blocks == (int(0.9 * (1 << 30)) - plan.weight_bytes - plan.activation_bytes
                               - plan.margin_bytes) // plan.block_bytes


def test_estimated_activations_bound_xla_memory_analysis(tmp_path):
    """memory.estimate_step_bytes against XLA:CPU's compiled peak temporaries of the same step
    (float32: XLA:CPU computes bfloat16 dots on float32 copies of the weights)."""
    mc = load_model_config(_config(tmp_path, vocab_size=8192))
    cfg = rt.RunnerConfig(block_size=16, num_blocks=64, max_model_len=256, max_num_seqs=64,
                          max_num_batched_tokens=256, dtype="float32")
    runner = AbstractRunner(mc, AbstractCheckpoint(mc), cfg, mesh=meshlib.make_mesh(1),
                            backend=resolve_backend("xla", "float32", "float32"))
    for key in [BucketKey(64, 64, 0), BucketKey(256, 1, 0), BucketKey(256, 64, 512)]:
        jitted, args = runner.step_function(key)
        temp = compat.peak_temp_bytes(jitted.lower(*args).compile())
        est = memory.estimate_step_bytes(
            num_tokens=key.t, num_seqs=key.s, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
            num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
            dtype_bytes=4)
        assert temp <= est <= 3 * temp, (key, temp, est)


def test_abstract_params_match_a_loaded_checkpoint(tiny_model):
    """The shapes the model's init declares are the tree the loader builds from safetensors."""
    from jaxserve.model.loader import load_model

    loaded = load_model(tiny_model("qwen2"))
    want = meshlib.shape_tree(loaded.params)
    assert AbstractCheckpoint(loaded.config).shapes() == want


def test_cli_lowers_every_bucket(tmp_path, capsys):
    path = _config(tmp_path)
    rc = cli.main(["lower", "--platform", "tpu", "--model", f"{path}/config.json", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "8", "--tp", "2", "--device-memory", "2GiB"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("lowered T=")]
    # 6 buckets and 3 decode-only ones; per layer the KV write and the attention kernel
    assert len(lines) == 9 and all("4 tpu_custom_call calls" in line for line in lines), out
    assert "memory per device x tp 2: 2.00 GiB x 0.9" in out
    assert "lowered 9 buckets for tpu" in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model"], "Model config '/nonexistent/model' not found"),
    (["--model", "{bad}"], "is not a JSON model config"),
    (["--model", "{cfg}", "--tp", "3"], "Cannot shard this model over tensor_parallel_size=3"),
    (["--model", "{cfg}", "--device-memory", "1MiB"], "out of device memory"),
])
def test_cli_failures_are_one_line(tmp_path, capsys, argv, message):
    cfg = _config(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    argv = [a.format(cfg=cfg, bad=tmp_path / "bad.json") for a in argv]
    assert cli.main(["lower", "--platform", "cuda", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: ") and message in err and err.count("\n") == 1, err



PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "models").glob("*.json"))


def _one_layer(tmp_path, preset: str) -> str:
    """A shipped preset cut to one layer: the real widths, heads, vocab and options, lowered fast."""
    hf = json.loads((Path(__file__).parents[1] / "configs" / "models" / f"{preset}.json").read_text())
    return _config(tmp_path, **{**hf, "num_hidden_layers": 1})


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("preset", PRESETS)
def test_family_shapes_lower(tmp_path, preset, platform):
    """Each supported family's shapes (configs/models), whole step, one bucket."""
    lowering = prepare(_one_layer(tmp_path, preset), platform,
                       EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=4096))
    step = lowering.lower(BucketKey(16, 8, 0))
    # a routed-expert layer's two grouped products are Pallas calls too (tpu_gmm; gpu_gmm on Hopper)
    mc, grouped_kernel = lowering.model, platform == "tpu" or lowering.runner.backend.gpu_moe_kernel
    gmm = 2 if grouped_kernel and mc.is_moe_layer(0) and mc.expert_format is None else 0
    assert (step.kernel_calls, step.num_devices) == (CALLS_PER_LAYER[platform] + gmm, 1), step.describe()


@pytest.mark.parametrize("preset,tp", [("llama-3.1-8b", 8), ("qwen2.5-1.5b", 2), ("qwen3-32b", 8)])
def test_family_shapes_lower_under_tp(tmp_path, preset, tp):
    lowering = prepare(_one_layer(tmp_path, preset), "cuda",
                       EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=4096,
                                    tensor_parallel_size=tp))
    step = lowering.lower(BucketKey(16, 8, 0))
    assert (step.kernel_calls, step.num_devices) == (1, tp), step.describe()


def test_presets_are_the_models_they_name():
    """Parameter counts of the presets against the published sizes (weights in bfloat16)."""
    billions = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21,
                "qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.7, "qwen3-8b": 8.19,
                "mistral-7b-v0.3": 7.25, "smollm2-135m": 0.135, "smollm2-1.7b": 1.71,
                "qwen3-embedding-0.6b": 0.596, "qwen3-reranker-0.6b": 0.596}
    def count(tree) -> int:
        return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))

    for name, want in billions.items():
        path = Path(__file__).parents[1] / "configs" / "models" / f"{name}.json"
        mc = load_model_config(str(path))
        shapes = AbstractCheckpoint(dataclasses.replace(mc, num_layers=1)).shapes()  # layers alike
        got = (count(shapes) + (mc.num_layers - 1) * count(shapes["layers_0"])) / 1e9
        assert abs(got - want) / want < 0.02, (name, got, want)


def test_decode_buckets_get_the_split_kv_kernel_on_gpu(tmp_path):
    """A GPU engine compiles decode-only buckets (every row one token) with the split-KV decode
    kernel, whose Mosaic call returns (outputs, lse); other buckets keep the prefill kernel."""
    import re

    lowering = prepare(_config(tmp_path), "cuda", EngineConfig(**ENGINE))
    keys = lowering.runner.all_buckets()
    decode = BucketKey(8, 8, 0, True)
    assert decode in keys and all(k.t == k.s for k in keys if k.decode)

    def mosaic_calls(key):
        text = lowering.export(key).mlir_module()
        return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]

    assert all(re.search(r"\) -> \(tensor<", c) for c in mosaic_calls(decode))
    assert not any(re.search(r"\) -> \(tensor<", c) for c in mosaic_calls(BucketKey(8, 8, 0)))


def test_decode_buckets_get_the_decode_block_sizes_on_tpu(tmp_path):
    """A TPU engine's decode-only buckets run the kernel with the table's decode row: one token
    per grid step (G = 4 q rows padded to 16 bf16 sublanes), not 32-token tiles (128 rows)."""
    lowering = prepare(_config(tmp_path), "tpu", EngineConfig(**ENGINE))
    keys = lowering.runner.all_buckets()
    decode, mixed = BucketKey(4, 4, 0, True), BucketKey(4, 4, 0)
    assert decode in keys and mixed in keys

    def attention_rows(key):
        text = lowering.export(key).mlir_module()
        call = next(line for line in text.splitlines() if 'kernel_name = "ragged_paged_attention_tpu"' in line)
        return int(re.search(r"-> tensor<2x(\d+)x128xbf16>", call).group(1))

    assert (attention_rows(decode), attention_rows(mixed)) == (4 * 16, 128)


@pytest.mark.parametrize("tp", [1, 8])
def test_tpu_long_context_keeps_smem_bounded(tmp_path, tp):
    """max_model_len 131072: 8192 blocks per sequence (32 KiB of table each). Tables live in SMEM
    (an HBM table would be DMAed in sub-tile slices, which Mosaic rejects), at most
    ``TABLE_SMEM_BYTES`` per attention call: more sequences split over several calls."""
    from pallas_kernels import tpu

    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=32, max_model_len=131072, tensor_parallel_size=tp)
    lowering = prepare(_config(tmp_path, max_position_embeddings=131072, num_hidden_layers=1), "tpu", cfg,
                       device_memory=64 << 30)
    assert lowering.runner.max_blocks == 8192
    for key in (BucketKey(32, 32, 0), BucketKey(16, 1, 0)):
        text = lowering.export(key).mlir_module()
        calls = [line for line in text.splitlines() if 'kernel_name = "ragged_paged_attention_tpu"' in line]
        assert len(calls) == -(-key.s // tpu.table_rows(key.s, 8192)) == (2 if key.s == 32 else 1)
        for call in calls:
            operands = call.rsplit(" : (", 1)[1]
            smem = [int(n) * 4 for n in re.findall(r"tensor<(\d+)xi32>", operands)]  # 1-D i32: SMEM
            assert max(smem) >= 8192 * 4 and sum(smem) <= tpu.TABLE_SMEM_BYTES + 4096, smem


@pytest.mark.parametrize("quantization", ["int8", "q4_k"])
def test_quantized_weights_lower_under_tp(tmp_path, quantization):
    """--quantization with --tp 2: the quantized parts are shapes sharded like their float kernels
    (about half of them per device), dequantized inside the lowered step."""
    lowering = prepare(_config(tmp_path), "cuda", EngineConfig(**ENGINE, tensor_parallel_size=2,
                                                                quantization=quantization))
    from jaxserve.runtime import quant_params
    from jaxserve.worker.lower import weight_bytes_per_device

    params = lowering.runner.params
    assert quant_params.has_quantized(params)
    float32 = _param_count(json.loads((tmp_path / "config.json").read_text())) * 4
    assert weight_bytes_per_device(params) <= 0.3 * float32 / 2 + 4096
    step = lowering.lower(BucketKey(8, 8, 0))
    assert (step.num_devices, step.kernel_calls) == (2, 2)


@pytest.mark.parametrize("kv,tp", [("int8", 1), ("fp8_e4m3", 2)])
def test_tpu_step_lowers_with_quantized_kv(tmp_path, kv, tp):
    """--kv-cache-dtype int8/fp8 on TPU: the Pallas write and attention over quantized tpu-fused
    pages (data [nb, 2*Hkv, bs, 128] and f32 scales [nb, 2*Hkv, bs], both sharded on kv heads)."""
    config = EngineConfig(**ENGINE, tensor_parallel_size=tp, kv_cache_dtype=kv, block_size=32)
    lowering = prepare(_config(tmp_path), "tpu", config)
    assert (lowering.runner.backend.attention, lowering.runner.backend.kv_layout) == ("pallas", "tpu-fused")
    exported = lowering.export(BucketKey(8, 8, 0))
    data, scale = exported.in_avals[len(jax.tree.leaves(lowering.runner.params)):][:2]
    assert data.shape == (lowering.plan.num_blocks, 4, 32, 128) and data.dtype == kv_sizing.kv_storage_dtype(kv)
    assert scale.shape == (lowering.plan.num_blocks, 4, 32) and scale.dtype == jax.numpy.float32
    step = lowering.lower(BucketKey(8, 8, 0))
    assert step.kernel_calls == CALLS_PER_LAYER["tpu"] * LLAMA["num_hidden_layers"], step.describe()
    assert step.num_devices == tp


def test_num_layers_cut_keeps_each_layer_kind():
    """`--num-layers N` compiles one layer of each kind first: Gemma 3's global layer (every 6th),
    GLM-4.5-Air's MoE layer after its dense one; a cut that cannot hold both MLP kinds is refused."""
    models = Path(__file__).parents[1] / "configs" / "models"
    gemma = load_model_config(str(models / "gemma-3-27b.json"))
    cut, layers = cut_layers(gemma, 2)
    assert layers == (0, 5) and [cut.layer_window(i) for i in range(2)] == [gemma.sliding_window, None]
    glm = load_model_config(str(models / "glm-4.5-air.json"))
    cut, layers = cut_layers(glm, 3)
    assert layers == (0, 1, 2) and (cut.is_moe_layer(0), cut.is_moe_layer(1), cut.moe_layers) == (False, True, (1, 2))
    with pytest.raises(UserError, match="--num-layers 1 cannot hold both .* pass --num-layers 2"):
        cut_layers(glm, 1)


@pytest.mark.parametrize("preset,tp", [("gemma-3-1b", 1), ("glm-4.5-air", 8), ("gpt-oss-20b", 1)])
def test_num_layers_cut_plans_the_whole_model(preset, tp):
    """The memory plan of a cut (`lower --compile --num-layers`) is the whole model's: its weights
    (dense, MoE and MXFP4-packed layers counted by kind) and its KV blocks, whose per-layer shape the
    cut compiles."""
    path = str(Path(__file__).parents[1] / "configs" / "models" / f"{preset}.json")
    config = EngineConfig(tensor_parallel_size=tp, max_model_len=4096)
    whole, cut = prepare(path, "cuda", config), prepare(path, "cuda", config, num_layers=2)
    assert cut.runner.model_cfg.num_layers == 2
    assert cut.plan == whole.plan and cut.total_weight_bytes == whole.total_weight_bytes
    assert cut.runner.kv.layers[0][0].shape == whole.runner.kv.layers[0][0].shape


def test_moe_estimate_counts_xla_gpus_dense_expert_product():
    """XLA:GPU turns the experts' ragged_dot into one masked dot over every expert (its operand is
    the T x k routed rows repeated per expert: 2 GiB at Qwen3-30B-A3B's T=512, compiled by ptxas):
    the cuda estimate counts that operand where ragged_dot runs (the xla backend, or a GPU other
    than Hopper); not where the Mosaic GPU grouped matmul does (pallas on sm_90a, the default), nor
    on TPU, nor for packed MXFP4 experts (blocked product)."""
    models = Path(__file__).parents[1] / "configs" / "models"
    config = EngineConfig(max_model_len=4096)
    key = BucketKey(512, 64, 0)
    kw = {"device_memory": 141 * 2**30, "num_layers": 1}
    cuda = prepare(str(models / "qwen3-30b-a3b.json"), "cuda", config, **kw)
    xla = prepare(str(models / "qwen3-30b-a3b.json"), "cuda", EngineConfig(max_model_len=4096,
                                                                           attention_backend="xla"), **kw)
    tpu = prepare(str(models / "qwen3-30b-a3b.json"), "tpu", config, **kw)
    mc = cuda.model
    assert cuda.runner.backend.gpu_moe_kernel and not xla.runner.backend.gpu_moe_kernel
    assert cuda.estimate(key) == tpu.estimate(key)
    assert xla.estimate(key) - tpu.estimate(key) == 512 * mc.num_experts_per_tok * mc.num_experts * mc.hidden_size * 2
    oss = prepare(str(models / "gpt-oss-20b.json"), "cuda", config, **kw)
    oss_tpu = prepare(str(models / "gpt-oss-20b.json"), "tpu", config, **kw)
    assert oss.estimate(key) == oss_tpu.estimate(key)
