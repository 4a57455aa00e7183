"""TP=1/2/4/8 give the same greedy tokens and logits; kv heads < TP; ~1/N of the weights per device;
clear errors for impossible layouts. (8 forced CPU devices: see conftest.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.model import sharding
from jaxserve.model.loader import load_model
from jaxserve.runtime import mesh as ml
from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.worker.runner import ModelRunner, RunnerConfig

BS = 16
TINY = dict(heads=8, kv_heads=2)  # 8 q heads allow TP=8; 2 kv heads: TP 4 and 8 replicate kv heads


def make_runner(lm, tp: int) -> ModelRunner:
    return ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
        tensor_parallel_size=tp))


def greedy_run(runner: ModelRunner, prompts, steps: int):
    """Prefill both prompts in one ragged step, then `steps` batched greedy decode steps.
    Returns logits [steps+1, 2, V] and tokens [steps+1, 2]."""
    seqs, starts = [list(p) for p in prompts], [0, 0]
    blocks = [[3, 9, 5], [12, 1, 7]]  # not contiguous
    all_logits, all_tokens = [], []
    for step in range(steps + 1):
        rows = [RowSpec(s, st, len(s) - st, b, Sampling(step=step)) for s, st, b in zip(seqs, starts, blocks)]
        batch, key, _ = runner.builder.build(rows)
        logits = runner.forward_logits(batch, key)  # writes the same K/V the step writes again
        assert logits.sharding.is_fully_replicated
        result = runner.execute(batch, key)
        assert result.tokens.sharding.is_fully_replicated  # sampled tokens replicated for the host
        tokens = runner.fetch(result, key.s, False)[0][:2]
        np.testing.assert_array_equal(tokens, np.asarray(logits)[:2].argmax(-1))
        all_logits.append(np.asarray(logits)[:2])
        all_tokens.append(tokens)
        starts = [len(x) for x in seqs]
        for x, tok in zip(seqs, tokens):
            x.append(int(tok))
    return np.stack(all_logits), np.stack(all_tokens)


def check_weight_bytes(runner: ModelRunner, source_params: dict, tp: int):
    """Each device holds 1/N of the sharded weights (+ the replicated norms), read from the shardings."""
    per_dev = ml.bytes_per_device(runner.params)
    leaves = jax.tree.leaves(runner.params)
    total = sum(x.nbytes for x in leaves)
    replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
    assert len(per_dev) == tp
    if tp > 1:
        assert replicated / total < 0.01, "only norms should be replicated"
    for dev, b in per_dev.items():
        assert b == (total - replicated) // tp + replicated, (dev, b)
    # against the checkpoint itself: 1/N, plus the k/v projection copies when tp > kv heads
    src = sum(np.asarray(w).nbytes for w in jax.tree.leaves(source_params))
    kv_src = sum(np.asarray(w).nbytes for path, w in ml._paths(source_params) if path[-2] in ("k_proj", "v_proj"))
    assert max(per_dev.values()) <= (src + (runner.kv_repeat - 1) * kv_src) / tp + replicated
    # the KV cache: 1/N of it per device
    k = runner.kv_caches[0][0]
    kv_dev = {s.device: s.data.nbytes for s in k.addressable_shards}
    assert set(kv_dev.values()) == {k.nbytes // tp}
    assert k.shape[2] == max(runner.source_config.num_kv_heads, tp)


# each TP size in at least one family: 2 (kv heads split), 4 and 8 (2 kv heads repeated 2x / 4x)
@pytest.mark.parametrize("arch,tps", [("llama", (1, 2, 8)), ("qwen3", (1, 4)), ("qwen2", (1, 4)),
                                      ("gemma3", (1, 2))])
def test_tp_same_tokens_and_logits(tiny_model, arch, tps):
    """llama: untied lm head; qwen3: q/k norms, head_dim 32; qwen2: q/k/v biases, tied embeddings;
    gemma3: sliding and global layers, head_dim 256, (1 + w) norms, final soft cap."""
    lm = load_model(tiny_model(arch, **TINY))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, lm.config.vocab_size, n).tolist() for n in (19, 11)]
    ref_logits = ref_tokens = None
    for tp in tps:
        runner = make_runner(lm, tp)
        assert runner.tensor_parallel_size == tp and runner.kv_repeat == max(1, tp // 2)
        check_weight_bytes(runner, lm.params, tp)
        logits, tokens = greedy_run(runner, prompts, steps=5)
        if ref_logits is None:
            ref_logits, ref_tokens = logits, tokens
            continue
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{arch} tp={tp}: greedy tokens differ")
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-5, f"{arch} tp={tp}: logits differ by {err:.2e} of their scale"


def test_collectives_are_megatron(tiny_model):
    """Per layer one all-reduce after o_proj and one after down_proj, one for the vocab-parallel
    embedding, one all-gather of the logits: no weight or KV-cache gathers."""
    import re

    lm = load_model(tiny_model("llama", **TINY))
    runner = make_runner(lm, 4)
    hlo = runner.executable(runner.builder.bucket_for(8, 2)).as_text()
    ops = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\(", hlo)
    assert ops.count("all-reduce") == 2 * lm.config.num_layers + 1, ops
    assert ops.count("all-gather") == 1 and len(ops) == 2 * lm.config.num_layers + 2, ops


def test_impossible_layouts_are_clear_errors(tiny_model):
    lm = load_model(tiny_model("llama", **TINY))
    cfg = RunnerConfig(block_size=BS, num_blocks=4, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16)
    import dataclasses

    with pytest.raises(ValueError, match=r"num_attention_heads=8 is not divisible by 3.*Valid tensor parallel sizes"
                                         r" for it: 1, 2, 4, 8"):
        ModelRunner(lm.config, lm.params, dataclasses.replace(cfg, tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"needs 16 devices, but only 8 cpu.*xla_force_host_platform_device_count=16"):
        ModelRunner(lm.config, lm.params, dataclasses.replace(cfg, tensor_parallel_size=16))
    odd = dataclasses.replace(lm.config, num_heads=12, num_kv_heads=3, intermediate_size=192)  # kv 3 vs tp 4
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 neither divides nor is divisible by 4"):
        sharding.check_layout(odd, 4)
    assert sharding.valid_tp_sizes(odd) == [1, 3, 6, 12]
    smol = dataclasses.replace(lm.config, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    assert sharding.valid_tp_sizes(smol) == [1, 3]  # SmolLM2-135M: 9 heads, 3 kv heads, intermediate 1536
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
