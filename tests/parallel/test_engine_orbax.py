"""The engine (scheduler + prefix cache) on a TP mesh, and Orbax checkpoints: `jaxserve convert`,
bit-identical weights, restore onto the mesh, identical outputs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.convert import convert_model
from jaxserve.model.orbax_io import OrbaxCheckpoint, is_orbax_dir
from jaxserve.runtime import mesh as ml

ENGINE_KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=48, precompile=False,
                 prefix_cache="radix")
SHARED = "The capital of France is Paris. The capital of Italy is Rome. JAX is a library for array computation"
PROMPTS = [SHARED + " and", SHARED + " for", SHARED + ". Once upon a time"]


def _generate(model, tp):
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, **ENGINE_KW)
    outs = []
    for p in PROMPTS:  # one at a time: later prompts hit the prefix cache
        outs += llm.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
                             use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
    """Lazily converted tiny llama (cheap fixture: see conftest.py)."""
    cache = {}

    def get(src):
        if src not in cache:
            cache[src] = tmp_path_factory.mktemp("orbax") / "ckpt"
            convert_model(src, cache[src])
        return str(cache[src])

    return get


def test_engine_on_tp_mesh_and_orbax_outputs(tiny_model, orbax_dir):
    hf = tiny_model("llama")  # 4 heads, 2 kv heads
    _, ref = _generate(hf, 1)
    llm2, out2 = _generate(hf, 2)
    eng = llm2.engine
    assert eng.runner.tensor_parallel_size == 2
    assert eng.runner.kv_caches[0][0].sharding.spec == ml.P(None, None, "model", None)
    stats = eng.get_stats()
    assert stats["num_compiles"] >= 1
    hits = {k: v for k, v in stats.items() if "hit" in k}
    assert any(v > 0 for v in hits.values()), f"the prefix cache was never hit: {stats}"
    for (t1, lp1), (t2, lp2) in zip(ref, out2):
        assert t1 == t2
        np.testing.assert_allclose(lp1, lp2, atol=1e-4)
    # the same model through `jaxserve convert` -> Orbax, restored onto the TP=2 mesh: identical outputs
    llm_o, out_o = _generate(orbax_dir(hf), 2)
    assert is_orbax_dir(llm_o.engine.loaded.path) and llm_o.engine.runner.tensor_parallel_size == 2
    assert out_o == out2


def test_orbax_round_trip_bit_identical(tiny_model, orbax_dir, tmp_path):
    src = tiny_model("qwen2", heads=8, kv_heads=2)  # biases + tied embeddings
    dst = orbax_dir(src)
    assert is_orbax_dir(dst)
    hf, ob = load_model(src), load_model(dst)
    assert isinstance(ob.params, OrbaxCheckpoint)
    assert ob.config == hf.config and ob.generation_defaults == hf.generation_defaults
    restored = ob.params.load_numpy()
    flat_hf, flat_ob = dict(ml._paths(hf.params)), dict(ml._paths(restored))
    assert flat_hf.keys() == flat_ob.keys()
    for k in flat_hf:
        assert flat_ob[k].dtype == flat_hf[k].dtype and np.array_equal(flat_ob[k], flat_hf[k]), k
    # restored straight onto a TP=4 mesh (kv heads replicated): the same arrays as placing the HF weights
    from jaxserve.worker.runner import ModelRunner, RunnerConfig

    cfg = RunnerConfig(block_size=16, num_blocks=4, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16,
                       tensor_parallel_size=4)
    a, b = ModelRunner(hf.config, hf.params, cfg), ModelRunner(ob.config, ob.params, cfg)
    for (path, x), (_, y) in zip(ml._paths(a.params), ml._paths(b.params)):
        assert x.sharding == y.sharding, path
        assert all(np.array_equal(s.data, t.data) for s, t in zip(x.addressable_shards, y.addressable_shards)), path
    # a self-contained directory: tokenizer and config travel with it
    from jaxserve.tokenizer import Tokenizer

    msgs = [{"role": "user", "content": "Café 東京 😀 def add(a, b)"}]
    ours, theirs = Tokenizer.from_pretrained(dst), Tokenizer.from_pretrained(src)
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="already exists"):
        convert_model(src, dst)
    with pytest.raises(ValueError, match="already a jaxserve Orbax checkpoint"):
        convert_model(dst, tmp_path / "again")


@pytest.mark.slow
def test_convert_default_gguf(tmp_path):
    """SmolLM2 GGUF -> Orbax via the CLI: tokenizer from GGUF metadata, bit-identical weights."""
    from jaxserve.cli import main
    from jaxserve.model.default_model import default_model_path
    from jaxserve.tokenizer import Tokenizer

    try:
        gguf = default_model_path(download=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"default model not installed: {e}")
    dst = tmp_path / "smol"
    assert main(["convert", "default", str(dst)]) == 0
    ref, got = load_model(str(gguf)), load_model(str(dst))
    assert got.config == ref.config
    restored = got.params.load_numpy()
    for path, w in ml._paths(ref.params):
        node = restored
        for k in path:
            node = node[k]
        assert np.array_equal(node, w), path
    a, b = Tokenizer.from_pretrained(gguf), Tokenizer.from_pretrained(dst)
    msgs = [{"role": "user", "content": "What is the capital of France? Café 東京 😀"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert a.eos_token_ids == b.eos_token_ids and a.bos_token_id == b.bos_token_id
    assert jax.tree.leaves(restored)[0].dtype == np.float32


def test_moe_orbax_round_trip_onto_an_expert_parallel_mesh(tiny_model, orbax_dir):
    """A tiny GLM-4.5 (routed experts stacked [E, ...], the router's correction bias, a shared
    expert, a dense layer 0) through `jaxserve convert`: the same config and bit-identical weights;
    restored straight onto an EP 2 mesh (whole experts per device), the same arrays, shard by shard,
    as placing the HF weights, and transformers' greedy tokens and logits (float32)."""
    import dataclasses

    import torch

    from jaxserve.worker.runner import ModelRunner, RunnerConfig
    from tests.model.test_hf_parity import hf_model
    from tests.parallel.test_tensor_parallel import BS, greedy_run

    src = tiny_model("glm4_moe")
    hf, ob = load_model(src), load_model(orbax_dir(src))
    assert isinstance(ob.params, OrbaxCheckpoint)
    assert ob.config == hf.config and ob.config.is_moe and ob.config.moe_layers == (1,)
    flat_hf, flat_ob = dict(ml._paths(hf.params)), dict(ml._paths(ob.params.load_numpy()))
    assert flat_hf.keys() == flat_ob.keys()
    assert any("e_score_correction_bias" in "/".join(k) for k in flat_hf), sorted(flat_hf)
    for k in flat_hf:
        assert flat_ob[k].dtype == flat_hf[k].dtype and np.array_equal(flat_ob[k], flat_hf[k]), k
    cfg = RunnerConfig(block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    ep = dataclasses.replace(cfg, tensor_parallel_size=2, enable_expert_parallel=True)
    a, b = ModelRunner(hf.config, hf.params, ep), ModelRunner(ob.config, ob.params, ep)
    experts = b.params["layers_1"]["mlp"]["experts"]["gate_proj"]
    assert experts.sharding.shard_shape(experts.shape)[0] == hf.config.num_experts // 2
    placed, restored = dict(ml._paths(a.params)), dict(ml._paths(b.params))  # keyed: the trees' orders differ
    assert placed.keys() == restored.keys()
    for path, x in placed.items():
        y = restored[path]
        assert x.sharding == y.sharding, path
        assert all(np.array_equal(s.data, t.data) for s, t in zip(x.addressable_shards, y.addressable_shards)), path
    del a, placed
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in (19, 11)]
    logits, tokens = greedy_run(b, prompts, steps=3)  # [4, 2, V], [4, 2]
    model = hf_model(src)  # transformers' float32 forward: each prompt and its greedy continuation
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p + tokens[:3, i].tolist()])).logits[0, len(p) - 1:].numpy()
        assert tokens[:, i].tolist() == ref.argmax(-1).tolist(), i
        assert np.abs(logits[:, i] - ref).max() <= 1e-4 * np.abs(ref).max(), i
