"""Tensor parallelism with quantized weights: quants and their scales shard like their float
kernels (whole blocks per device), TP=2 gives TP=1's greedy tokens in each format, each device
holds about half the weights, and a TP size that would split a block is a clear error.
(8 forced CPU devices: see conftest.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.errors import UserError
from jaxserve.model.loader import load_model
from jaxserve.runtime import mesh as ml
from jaxserve.runtime import quant_params, weight_formats
from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.parallel.test_tensor_parallel import BS

# K of every matrix in whole Q4_K / Q6_K super-blocks on each of 2 devices: hidden 512 (o_proj,
# q/k/v, gate/up), intermediate 1024 (down_proj)
TINY = dict(hidden=512, heads=4, kv_heads=2, layers=1)


def make_runner(lm, tp: int, quantization: str) -> ModelRunner:
    return ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
        tensor_parallel_size=tp, quantization=quantization))


def greedy_logits(runner: ModelRunner, prompts, steps: int):
    """Both prompts prefilled in one ragged step, then `steps` greedy decode steps (argmax of the
    logits, one compiled forward per bucket): logits [steps + 1, 2, V] and tokens [steps + 1, 2]."""
    seqs, starts, blocks = [list(p) for p in prompts], [0, 0], [[3, 9, 5], [12, 1, 7]]
    all_logits = []
    for step in range(steps + 1):
        rows = [RowSpec(s, st, len(s) - st, b, Sampling(step=step)) for s, st, b in zip(seqs, starts, blocks)]
        logits = np.asarray(runner.forward_logits(*runner.builder.build(rows)[:2]))[:2]
        all_logits.append(logits)
        starts = [len(x) for x in seqs]
        for x, tok in zip(seqs, logits.argmax(-1)):
            x.append(int(tok))
    logits = np.stack(all_logits)
    return logits, logits.argmax(-1)


@pytest.mark.parametrize("quantization", ["int8", "q8_0", "q4_1", "q4_k", "q6_k"])
def test_tp2_same_greedy_tokens_as_tp1(tiny_model, quantization):
    lm = load_model(tiny_model("llama", **TINY))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, lm.config.vocab_size, n).tolist() for n in (19, 11)]
    results = {}
    for tp in (1, 2):
        runner = make_runner(lm, tp, quantization)
        kinds = {type(w).__name__ for w in jax.tree.leaves(runner.params, is_leaf=weight_formats.is_quantized)
                 if weight_formats.is_quantized(w)}
        assert len(kinds) == 1 and quant_params.weight_bytes(runner.params) < 0.3 * sum(
            np.asarray(w).nbytes for w in jax.tree.leaves(lm.params)), kinds
        per_dev = ml.bytes_per_device(runner.params)
        assert len(per_dev) == tp and max(per_dev.values()) <= 1.02 * quant_params.weight_bytes(runner.params) / tp
        results[tp] = greedy_logits(runner, prompts, steps=4)
    (ref_logits, ref_tokens), (logits, tokens) = results[1], results[2]
    np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{quantization}: TP=2 greedy tokens differ")
    assert np.abs(logits - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()


def test_block_split_by_tp_is_a_clear_error(tiny_model):
    """hidden 256: o_proj's K is one Q4_K super-block, which 2 devices cannot share."""
    lm = load_model(tiny_model("llama", hidden=256, heads=4, kv_heads=2))
    with pytest.raises(UserError, match=r"tensor_parallel_size=2 splits the blocks of 256 along K of the quantized "
                                        r"layers_0/self_attn/o_proj/kernel \(Q4KWeight, K=256, N=256\): use one of 1"):
        make_runner(lm, 2, "q4_k")
    make_runner(lm, 2, "q4_1")  # 32-blocks split fine


@pytest.mark.parametrize("quantization", ["int8", "q8_0", "q4_1"])
def test_kv_heads_repeated_with_quantized_weights(tiny_model, quantization):
    """TP=4 over 2 kv heads: each quantized k/v head (head_dim 128: two 64-column panels) is
    repeated as stored, one per device, and the greedy tokens are TP=1's."""
    lm = load_model(tiny_model("llama", **TINY))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, lm.config.vocab_size, n).tolist() for n in (17, 9)]
    ref_logits, ref_tokens = greedy_logits(make_runner(lm, 1, quantization), prompts, steps=3)
    runner = make_runner(lm, 4, quantization)
    k = runner.params["layers_0"]["self_attn"]["k_proj"]["kernel"]
    assert weight_formats.is_quantized(k) and runner.model_cfg.num_kv_heads == 4
    assert jax.eval_shape(weight_formats.dequantize, k).shape == (512, 4 * 128)  # [H, 4 heads x D]
    # the vocab's 6 panels do not divide over 4 devices: the quantized table splits its hidden axis instead
    table = runner.params["embed_tokens"]["embedding"][0]
    assert weight_formats.is_quantized(runner.params["embed_tokens"]["embedding"])
    assert table.sharding.shard_shape(table.shape) == (table.shape[0], table.shape[1] // 4, *table.shape[2:])
    logits, tokens = greedy_logits(runner, prompts, steps=3)
    np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{quantization}: TP=4 greedy tokens differ")
    assert np.abs(logits - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()


def test_kv_head_repeat_of_a_partial_panel_is_a_clear_error(tiny_model):
    """head_dim 32: a quantized k/v head is half a 64-column panel, which cannot be repeated alone."""
    lm = load_model(tiny_model("llama", hidden=256, heads=8, kv_heads=2, layers=1))
    with pytest.raises(UserError, match=r"whole 64-column panels, but head_dim is 32: use a tensor parallel size "
                                        r"that divides 2"):
        make_runner(lm, 4, "int8")
