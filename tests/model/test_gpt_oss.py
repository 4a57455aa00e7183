"""gpt-oss against transformers (float32, eager attention): a tiny random GptOssForCausalLM with q/k/v/o
biases, per-head sinks (perturbed to ~N(0, 1) so they bite), sliding (window 8) and full layers
alternating, YaRN (4x an original context of 16, positions past it), 8 experts top 2 with a
biased router, expert biases and a SwiGLU clamp (limit 1.0) that bites. KV blocks of 4 tokens and
prefill chunks of 6, so windows, blocks and chunks straddle each other. The model has sinks, so
the backend resolves to xla (the native CPU / Pallas kernels lack sinks; runtime/backend.py).

MXFP4: the tiny model's experts quantized in the test into HF's packed layout (`*_blocks`,
`*_scales`, quantization_config mxfp4) load kept packed, and run within a stated tolerance of the
same quantized values stored as float experts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.runtime import mxfp4
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_hf_parity import assert_greedy_matches_hf, hf_model, run_logits

LAYERS = 2
BS = 4  # KV block size: the window (8) spans blocks


@pytest.fixture(scope="module")
def gpt_oss(tiny_model):
    return tiny_model("gpt_oss", layers=LAYERS)


def test_gpt_oss_config(gpt_oss):
    c = load_model(gpt_oss).config
    assert c.layer_types == ("sliding_attention", "full_attention")
    assert [c.layer_window(i) for i in range(LAYERS)] == [8, None]
    assert c.attention_sinks and c.o_proj_bias and c.attention_bias and c.router == "topk_softmax"
    assert c.moe_layers == (0, 1) and c.num_experts == 8 and c.moe_intermediate_size == 128
    assert c.expert_act == "swiglu_clamp" and c.swiglu_limit == 1.0 and c.expert_format is None
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_attention_factors()[0] > 1.0


def _runner(path, block_size=BS, **kw):
    lm = load_model(path)
    return lm, ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=block_size, num_blocks=24, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, **kw))


def _logits(runner, ids, chunks, decodes, blocks):
    got, start = [], 0
    for n in chunks:
        got.append(run_logits(runner, ids, start, n, blocks))
        start += n
    for p in range(start, start + decodes):
        got.append(run_logits(runner, ids, p, 1, blocks))
    return np.stack(got)


CHUNKS, DECODES = [6, 6, 6, 6, 6], 6  # 30 prompt tokens in chunks of 6, then 6 decodes to position 35
BLOCKS = [9, 2, 14, 5, 11, 3, 17, 7, 20, 1]  # deliberately not contiguous


def _rows(chunks, decodes):
    ends = np.cumsum(chunks) - 1
    return list(ends) + list(range(sum(chunks), sum(chunks) + decodes))


# pallas: the TPU kernel, interpreted (its float32 pages hold a multiple of 8 tokens)
@pytest.mark.parametrize("attention,block_size", [("cpu", BS), ("xla", BS), ("pallas", 8)])
def test_gpt_oss_logits_match_transformers(gpt_oss, attention, block_size):
    import torch

    lm, runner = _runner(gpt_oss, block_size, attention_backend=attention)
    assert runner.backend.attention == attention
    ids = np.random.default_rng(1).integers(3, lm.config.vocab_size, size=sum(CHUNKS) + DECODES).tolist()
    with torch.no_grad():
        ref = hf_model(gpt_oss)(torch.tensor([ids])).logits[0].numpy()
    got = _logits(runner, ids, CHUNKS, DECODES, BLOCKS)
    err = np.abs(got - ref[_rows(CHUNKS, DECODES)]).max() / np.abs(ref).max()
    assert err <= 1e-4, f"max abs logit diff {err:.2e} relative to logit scale"


def test_gpt_oss_greedy_chunked_and_cached(gpt_oss):

    from jaxserve import LLM

    llm = LLM(gpt_oss, precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, num_blocks=48,
              block_size=BS, prefix_cache="hash")
    prompt = "The capital of France is Paris. The capital of Italy is Rome. def add(a, b):\n    return a + b\n"
    ids = llm.get_tokenizer().encode(prompt)
    assert 16 < len(ids) < 60
    assert_greedy_matches_hf(llm, gpt_oss, prompt, 10, min_hits=16)


# ---- MXFP4 ---------------------------------------------------------------------------------------
def test_mxfp4_decode_is_exact():
    """Every code and a spread of exponents: the jnp decode equals the numpy reference bit for bit,
    and quantize -> decode round-trips values already on the e2m1 grid."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(3, 5, 4), dtype=np.uint8)
    got = np.asarray(mxfp4.decode(blocks, scales))
    np.testing.assert_array_equal(got, mxfp4.decode_numpy(blocks, scales).astype(np.float32))
    w = mxfp4.Mxfp4Weight(blocks, scales)
    assert w.shape == (3, 128, 5)
    again = mxfp4.quantize(np.asarray(w.dequantize()))
    np.testing.assert_array_equal(np.asarray(again.dequantize()), np.asarray(w.dequantize()))


def _moe_reference(x, ids, weights, wg, wu, wd, bg, bu, act):
    """numpy float64: sum_j weights * (act(x Wg + bg, x Wu + bu) Wd) per token."""
    out = np.zeros((x.shape[0], wd.shape[-1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            out[t] += weights[t, j] * (act(x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e]) @ wd[e])
    return out


def test_mxfp4_grouped_experts_match_numpy_at_every_row_count():
    """The routed experts with MXFP4 weights (decoded per tile inside the step) against an exact
    numpy reference, for 1..113 real rows (one 113-row executable, `num_rows` real rows, as the
    engine runs padded buckets) and at 1, 7 and 113 rows as their own shapes."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runtime.moe import blocked_ragged_dot, grouped_experts, swiglu_clamp

    rng = np.random.default_rng(2)
    e, h, i, k = 8, 64, 96, 2
    wg, wu = (mxfp4.quantize(rng.normal(0, 0.1, (e, h, i))) for _ in range(2))
    wd = mxfp4.quantize(rng.normal(0, 0.1, (e, i, h)))
    bg, bu = rng.normal(0, 0.1, (e, i)).astype(np.float32), rng.normal(0, 0.1, (e, i)).astype(np.float32)
    f64 = [mxfp4.decode_numpy(w.blocks, w.scales).swapaxes(-1, -2) for w in (wg, wu, wd)]

    def act_np(g, u):
        g = np.minimum(g, 1.0)
        return (np.clip(u, -1.0, 1.0) + 1) * g / (1 + np.exp(-1.702 * g))

    act = swiglu_clamp(1.702, 1.0)
    run = jax.jit(lambda x, ids, w, n, wg, wu, wd, b: grouped_experts(
        x, ids, w, wg, wu, wd, n, matmul=blocked_ragged_dot, biases=b, act=act))
    x = rng.normal(0, 1, (113, h)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(113)]).astype(np.int32)
    w = rng.dirichlet(np.ones(k), 113).astype(np.float32)
    want = _moe_reference(x, ids, w, *f64, bg, bu, act_np)
    scale = np.abs(want).max()
    for rows in range(1, 114):
        got = np.asarray(run(x, ids, w, jnp.array([rows], jnp.int32), wg, wu, wd, (bg, bu)))
        assert np.abs(got[:rows] - want[:rows]).max() <= 1e-5 * scale, rows
        assert not got[rows:].any(), rows  # padding rows: exactly zero
    for rows in (1, 7, 113):
        got = np.asarray(run(x[:rows], ids[:rows], w[:rows], jnp.array([rows], jnp.int32), wg, wu, wd, (bg, bu)))
        assert np.abs(got - want[:rows]).max() <= 1e-5 * scale, rows
    # I = 96 (3 blocks) padded to 128 as TP 4 pads it (model/sharding.py): zero rows and blocks change nothing
    from types import SimpleNamespace

    from jaxserve.model.expert_padding import pad_packed_experts

    tree = {"layers_0": {"mlp": {"experts": dict(gate_proj=wg, up_proj=wu, down_proj=wd, gate_bias=bg, up_bias=bu)}}}
    padded = pad_packed_experts(tree, SimpleNamespace(moe_intermediate_size=i, moe_layers=(0,)),
                                SimpleNamespace(moe_intermediate_size=128))["layers_0"]["mlp"]["experts"]
    assert padded["gate_proj"].shape == (e, h, 128) and padded["down_proj"].shape == (e, 128, h)
    got = np.asarray(run(x, ids, w, jnp.array([113], jnp.int32), padded["gate_proj"], padded["up_proj"],
                         padded["down_proj"], (padded["gate_bias"], padded["up_bias"])))
    assert np.abs(got - want).max() <= 1e-5 * scale


def mxfp4_checkpoints(src, tmp_path):
    """The tiny model with its experts quantized: (MXFP4 checkpoint dir, the same values as float)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(f"{src}/model.safetensors")
    packed, floats = dict(weights), dict(weights)
    for name in list(weights):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q = mxfp4.quantize(weights[name])  # [E, K, N] -> blocks [E, N, K/32, 16]
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = np.asarray(q.blocks), np.asarray(q.scales)
            floats[name] = np.asarray(q.dequantize(), np.float32)
    hf = json.load(open(f"{src}/config.json"))
    out = {}
    # dequantize: how transformers loads an MXFP4 checkpoint on CPU (jaxserve ignores the key)
    mx = {"quant_method": "mxfp4", "dequantize": True}
    for kind, tensors, cfg in (("mxfp4", packed, hf | {"quantization_config": mx}),
                               ("float", floats, hf)):
        d = tmp_path / kind
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{src}/{f}", d / f)
        out[kind] = str(d)
    return out["mxfp4"], out["float"]


def test_mxfp4_model_matches_its_dequantized_float_model(gpt_oss, tmp_path):
    """Tolerance: 1e-5 of the logit scale (the decode is exact; only the summation order differs).
    The same MXFP4 checkpoint as transformers reads it (its own dequantization: the layout, nibble
    order and exponent bias are HF's) within 1e-4, as the float model is. Bytes per weight of the
    packed experts: 4.25 bits, also once laid out for the native kernel."""
    import torch

    packed_dir, float_dir = mxfp4_checkpoints(gpt_oss, tmp_path)
    lm_q, runner_q = _runner(packed_dir)
    experts = lm_q.params["layers_0"]["mlp"]["experts"]
    assert lm_q.config.expert_format == "mxfp4"
    assert all(isinstance(experts[p], mxfp4.Mxfp4Weight) for p in ("gate_proj", "up_proj", "down_proj"))
    n = sum(int(np.prod(experts[p].shape)) for p in ("gate_proj", "up_proj", "down_proj"))
    stored = sum(mxfp4.weight_bytes(experts[p]) for p in ("gate_proj", "up_proj", "down_proj"))
    assert stored * 8 / n == mxfp4.BITS_PER_WEIGHT == 4.25
    if runner_q.backend.native_linear:  # in the native kernel's panels (csrc/quant_matmul.cc kMXFP4): the same bytes
        from jaxserve.runtime.quant_params import weight_bytes

        placed = runner_q.params["layers_0"]["mlp"]["experts"]
        assert all(isinstance(placed[p].w, mxfp4.Mxfp4Panels) for p in ("gate_proj", "up_proj", "down_proj"))
        assert weight_bytes([placed[p] for p in ("gate_proj", "up_proj", "down_proj")]) == stored
    _, runner_f = _runner(float_dir)
    ids = np.random.default_rng(3).integers(3, lm_q.config.vocab_size, size=sum(CHUNKS) + DECODES).tolist()
    got = _logits(runner_q, ids, CHUNKS, DECODES, BLOCKS)
    want = _logits(runner_f, ids, CHUNKS, DECODES, BLOCKS)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-5, f"MXFP4 vs dequantized float: {err:.2e} of the logit scale"
    with torch.no_grad():
        ref = hf_model(packed_dir)(torch.tensor([ids])).logits[0].numpy()[_rows(CHUNKS, DECODES)]
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"MXFP4 vs transformers reading the same checkpoint: {err:.2e} of the logit scale"


def test_mxfp4_checkpoint_convert_is_refused_by_name(gpt_oss, tmp_path):
    from jaxserve.errors import UserError
    from jaxserve.convert import convert_model

    packed_dir, _ = mxfp4_checkpoints(gpt_oss, tmp_path)
    with pytest.raises(UserError, match="MXFP4.*serve the Hugging Face directory"):
        convert_model(packed_dir, tmp_path / "out")


def test_mxfp4a8_model_close_to_the_exact_mxfp4_path(gpt_oss, tmp_path):
    """--quantization mxfp4a8 (MXFP4 experts times int8 activations, csrc/dot_matmul.cc kMXFP4A8)
    against the same checkpoint's exact path (float32 activations): the expert weights are read
    exactly, only the experts' inputs are rounded to int8 per block of 32 (each within 0.5 / 127 of
    its block's largest: ~0.3% of an expert product's scale on these narrow random experts (hidden
    64); through two MoE layers and the attention they feed, measured 7.5e-3 of the logit scale
    here (1.1e-2 over a 6-token prefill and 2 decodes), so 3e-2 (and not 0: the int8 path ran).
    One prefill step of 8 tokens (one compile each); then the engine serves the format end to end (greedy, no crash)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runtime.weight_formats import ExpertStack

    packed_dir, _ = mxfp4_checkpoints(gpt_oss, tmp_path)
    _, exact = _runner(packed_dir)
    _, a8 = _runner(packed_dir, quantization="mxfp4a8")
    placed = a8.params["layers_0"]["mlp"]["experts"]
    assert all(isinstance(placed[p], ExpertStack) and isinstance(placed[p].w, mxfp4.Mxfp4A8Weight)
               for p in ("gate_proj", "up_proj", "down_proj"))
    ids = np.random.default_rng(4).integers(3, exact.model_cfg.vocab_size, size=8).tolist()
    got, want = (run_logits(r, ids, 0, 8, BLOCKS) for r in (a8, exact))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= 3e-2, f"mxfp4a8 vs the exact MXFP4 path: {err:.2e} of the logit scale"
    llm = LLM(packed_dir, quantization="mxfp4a8", precompile=False, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, num_blocks=16)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
