"""GGUF blocks kept quantized (`load_gguf(keep_quantized=True)`): every kept tensor reads exactly as
`gguf.quants.dequantize` (with llama.cpp's q/k row permutation undone) gives it, no float copy is
made of them, and the weights in memory stay within the 4-bit / 8-bit budgets."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxserve.model import default_model as dm
from jaxserve.model.config import ModelConfig
from jaxserve.model.gguf_loader import load_gguf
from jaxserve.model.weights import hf_to_params
from jaxserve.runtime import kquants, quant_params, weight_formats

RNG = np.random.default_rng(0)
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 64, 2, 2, 128, 128


def float_bytes(params) -> int:
    """Bytes of the same weights in float32."""
    import jax

    shapes = [jax.eval_shape(weight_formats.dequantize, x) if weight_formats.is_quantized(x) else x
              for x in jax.tree.leaves(params, is_leaf=weight_formats.is_quantized)]
    return sum(int(np.prod(x.shape)) * 4 for x in shapes)


def write_tiny_gguf(path, matrix_type: str, arch: str = "llama", hidden: int = HIDDEN, inter: int = INTER,
                    types: dict | None = None) -> None:
    """A 2-layer model whose matrices are `matrix_type` blocks (as `gguf` quantizes them; K-quants
    as kquants.quantize_gguf writes them), norms F32. `types`: other types for some matrices
    ({"ffn_down": "Q6_K"}), as llama.cpp's mixes (Q4_K_M) have them."""
    HIDDEN, INTER = hidden, inter  # noqa: N806 (the module's sizes, for this file)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 2), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)

    def matrix(name, rows, cols):
        kind = (types or {}).get(name.split(".")[-2], matrix_type)
        qt, x = gguf.GGMLQuantizationType[kind], RNG.standard_normal((rows, cols)).astype(np.float32) * 0.1
        raw = kquants.quantize_gguf(x, kind) if kind in kquants.FORMATS else gguf.quants.quantize(x, qt)
        w.add_tensor(name, raw, raw_dtype=qt)

    matrix("token_embd.weight", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(2):
        for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", KV_HEADS * HIDDEN // HEADS, HIDDEN),
                                 ("attn_v", KV_HEADS * HIDDEN // HEADS, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                                 ("ffn_gate", INTER, HIDDEN), ("ffn_up", INTER, HIDDEN), ("ffn_down", HIDDEN, INTER)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_kept_exactly(path) -> dict:
    """Every tensor of `path`: kept-quantized reads bit for bit as the float load; returns the
    kept weights."""
    _, floats = load_gguf(path)
    _, kept = load_gguf(path, keep_quantized=True)
    assert set(kept) == set(floats)
    for name, w in kept.items():
        if weight_formats.is_quantized(w):
            np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(w)).T, floats[name], err_msg=name)
        else:
            np.testing.assert_array_equal(w, floats[name], err_msg=name)
    return kept


@pytest.mark.parametrize("matrix_type,budget", [("Q4_0", 0.17), ("Q4_1", 0.17), ("Q8_0", 0.30)])
def test_tiny_gguf_kept_packed(tmp_path, matrix_type, budget):
    p = tmp_path / "m.gguf"
    write_tiny_gguf(p, matrix_type)  # llama: q/k rows are stored permuted
    kept = assert_kept_exactly(p)
    matrices = [n for n in kept if kept[n].__class__ is not np.ndarray]
    assert len(matrices) == 1 + 2 * 7  # every matrix stayed in its blocks
    cfg = ModelConfig.from_hf(load_gguf(p)[0])
    params = hf_to_params(kept, cfg)
    assert quant_params.weight_bytes(params) <= budget * float_bytes(params)


def test_default_model_kept_as_q4_1_and_q8_0():
    path = dm.default_model_path(download=False)
    kept = assert_kept_exactly(path)
    kinds = {type(w).__name__ for w in kept.values()}
    assert kinds == {"Q4Weight", "Q8Weight", "ndarray"}  # Q4_1 layers, a Q8_0 embedding, F32 norms
    assert sum(isinstance(w, np.ndarray) and w.ndim == 2 for w in kept.values()) == 0
    total = quant_params.weight_bytes(kept)
    assert total <= 0.18 * 134_515_008 * 4  # 4.5-5 bits a weight (the Q8_0 embedding: 8.5)


K_SIZES = {"hidden": 256, "inter": 512}  # K-quants' super-blocks: K in multiples of 256


@pytest.mark.parametrize("matrix_type,types,budget", [("Q4_K", None, 0.17), ("Q6_K", None, 0.22),
                                                      ("Q4_K", {"ffn_down": "Q6_K", "attn_v": "Q6_K"}, 0.17)])
def test_tiny_k_quant_gguf_kept_packed(tmp_path, matrix_type, types, budget):
    p = tmp_path / "m.gguf"
    write_tiny_gguf(p, matrix_type, types=types, **K_SIZES)
    kept = assert_kept_exactly(p)
    kinds = {type(w).__name__ for w in kept.values() if weight_formats.is_quantized(w)}
    assert kinds == ({"Q4KWeight", "Q6KWeight"} if types else {f"{matrix_type[:2]}KWeight"})
    assert sum(weight_formats.is_quantized(w) for w in kept.values()) == 1 + 2 * 7
    cfg = ModelConfig.from_hf(load_gguf(p)[0])
    params = hf_to_params(kept, cfg)
    assert quant_params.weight_bytes(params) <= budget * float_bytes(params)


def test_k_quant_gguf_runs_as_its_float_model(tmp_path):
    """A Q4_K / Q6_K mix kept packed gives the float32 (dequantized) model's greedy tokens, and
    logits equal to the bit: each block decodes exactly and the native kernel sums in the float32
    kernel's order."""
    from tests.parallel.test_tensor_parallel import greedy_run, make_runner

    from jaxserve.model.loader import load_model

    p = tmp_path / "m.gguf"
    write_tiny_gguf(p, "Q4_K", types={"ffn_down": "Q6_K"}, **K_SIZES)
    prompts = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14]]
    packed = make_runner(load_model(str(p), quantization="gguf"), 1)
    assert quant_params.has_quantized(packed.params)
    logits, tokens = greedy_run(packed, prompts, 4)
    ref_logits, ref_tokens = greedy_run(make_runner(load_model(str(p)), 1), prompts, 4)
    np.testing.assert_array_equal(tokens, ref_tokens)
    if packed.backend.native_linear:
        np.testing.assert_array_equal(logits, ref_logits)
    else:
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("matrix_type,kind,budget", [("Q4_0", "W4A8Weight", 0.17), ("Q4_1", "W4A8Weight", 0.17),
                                                     ("Q8_0", "Q8A8Weight", 0.30)])
def test_tiny_gguf_as_w4a8(tmp_path, matrix_type, kind, budget):
    """quantization="w4a8" keeps a GGUF's 4-bit and Q8_0 blocks (the same values, laid out for int8
    activations: W4A8Weight, Q8A8Weight) and runs them with activations quantized per block of 32:
    the float model's logits to within that rounding, and the 4-bit / 8-bit budget."""
    import jax

    from tests.parallel.test_tensor_parallel import BS, greedy_run

    from jaxserve.model.loader import load_model
    from jaxserve.worker.runner import ModelRunner, RunnerConfig

    p = tmp_path / "m.gguf"
    write_tiny_gguf(p, matrix_type)

    def runner(quantization):
        lm = load_model(str(p), quantization=quantization)
        return ModelRunner(lm.config, lm.params, RunnerConfig(
            block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
            quantization=quantization))

    w4, ref = runner("w4a8"), runner(None)
    kept = {type(w) for w in jax.tree.leaves(w4.params, is_leaf=weight_formats.is_quantized)
            if weight_formats.is_quantized(w)}
    assert kept == {getattr(weight_formats, kind)}
    assert quant_params.weight_bytes(w4.params) <= budget * float_bytes(w4.params)
    _, floats = load_gguf(p)
    got = dict(jax.tree_util.tree_flatten_with_path(w4.params, is_leaf=weight_formats.is_quantized)[0])
    q_proj = next(w for path, w in got.items() if "q_proj" in jax.tree_util.keystr(path))
    assert q_proj.q.shape[1] == HIDDEN // (8 if kind == "W4A8Weight" else 4)  # two k quads a byte, or one
    layer0 = [w for path, w in got.items() if "layers_0" in jax.tree_util.keystr(path) and "down_proj" in
              jax.tree_util.keystr(path)][0]
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(layer0)).T,
                                  floats["model.layers.0.mlp.down_proj.weight"])
    prompts = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14]]
    logits, tokens = greedy_run(w4, prompts, 3)
    ref_logits, ref_tokens = greedy_run(ref, prompts, 3)
    scale = np.abs(ref_logits).max()
    assert np.abs(logits[0] - ref_logits[0]).max() <= 0.03 * scale  # the prefill, same inputs
    assert not np.array_equal(logits[0], ref_logits[0])  # the activations were quantized


def test_bfloat16_load_gives_the_float32_loads_packed_weights_bit_for_bit():
    """`--quantization bfloat16` on a GGUF: the loader casts each kernel (and the embedding table) to
    bfloat16 as it dequantizes it, instead of holding the float32 model first (generate's load peak,
    bench/RESULTS.md). Packed by quantize_params, every leaf equals the float32 load's, bit for bit;
    norms stay float32."""
    import jax
    import ml_dtypes

    from jaxserve.model.loader import load_model

    path = str(dm.default_model_path(download=False))
    cast = load_model(path, quantization="bfloat16").params
    assert cast["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == ml_dtypes.bfloat16  # q/k unpermuted first
    assert cast["embed_tokens"]["embedding"].dtype == ml_dtypes.bfloat16
    assert cast["layers_0"]["input_layernorm"]["weight"].dtype == np.float32
    ref = load_model(path).params
    assert ref["layers_0"]["mlp"]["down_proj"]["kernel"].dtype == np.float32
    packed = [quant_params.quantize_params(p, "bfloat16") for p in (cast, ref)]
    leaves = [jax.tree_util.tree_leaves_with_path(p) for p in packed]
    assert [k for k, _ in leaves[0]] == [k for k, _ in leaves[1]]
    for (key, a), (_, b) in zip(*leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), key
