"""Pooling requests (LLM.embed, LLM.score): the pooled final hidden states of a tiny random Qwen3
equal transformers' (AutoModel's last_hidden_state, same pooling) within 1e-4 cosine distance,
whatever the batching, chunking or prefix-cache hits; the reranker's p(yes) equals a softmax over
transformers' last-position logits of the two score tokens; no KV block is left behind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.errors import UserError
from jaxserve.pooling import PoolingConfig
from jaxserve.rerank import pair_prompt
from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free

TEXTS = ["The capital of France is Paris.", "JAX is a library", "one, two, three, four. " * 8, "a"]
SCORE_TOKENS = "a,is"  # single tokens of the tiny vocabulary, standing in for Qwen3-Reranker's no,yes


def hidden_states(path, ids):
    """transformers' final-norm hidden states f64[len(ids), H] (one forward pass, no cache)."""
    import torch

    model = _hf_model(path)
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


_MODELS: dict = {}


def _hf_model(path):
    import torch
    import transformers

    if path not in _MODELS:
        _MODELS[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


def reference_embedding(path, ids, method: str) -> np.ndarray:
    h = hidden_states(path, ids)
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
    return v / np.linalg.norm(v)


def reference_score(path, ids, tokens: list[int]) -> float:
    import torch

    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([ids])).logits[0, -1].double()
    return float(torch.softmax(logits[tokens], 0)[1])


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    assert 1 - float(got @ want) / float(np.linalg.norm(got) * np.linalg.norm(want)) < 1e-4


def with_pooling(src: str, dst, mode: str) -> str:
    """A copy of the model with sentence-transformers files pooling by `mode` and normalising."""
    shutil.copytree(src, dst)
    (dst / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                f"pooling_mode_{mode}": True}))
    return str(dst)


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3):
    """Chunked prefill (16-token steps) and the prefix cache on."""
    return LLM(qwen3, use_tqdm=False, score_tokens=SCORE_TOKENS, **{**ENGINE_KW, "max_num_batched_tokens": 16})


def test_last_token_embedding_equals_transformers_batched_chunked_and_cached(llm, qwen3):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    assert llm.engine.pooling_config == PoolingConfig("last", True, False, False)  # no sentence-transformers files
    batched = llm.embed(TEXTS, use_tqdm=False)  # all at once, the long one in 16-token chunks
    hits0 = llm.engine.get_stats()["prefix_cache_hit_blocks"]
    alone = [llm.embed(p, use_tqdm=False)[0] for p in ids]  # one by one, as token ids: cache hits
    assert llm.engine.get_stats()["prefix_cache_hit_blocks"] > hits0
    for i, p in enumerate(ids):
        want = reference_embedding(qwen3, p, "last")
        assert_close(batched[i], want)
        assert_close(alone[i], want)
        assert abs(np.linalg.norm(batched[i]) - 1) < 1e-5
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode,method", [("mean_tokens", "mean"), ("cls_token", "cls")])
def test_mean_and_cls_pooling_from_sentence_transformers_files(qwen3, tmp_path, mode, method):
    path = with_pooling(qwen3, tmp_path / "st", mode)
    llm = LLM(path, use_tqdm=False, **{**ENGINE_KW, "max_num_batched_tokens": 16, "max_num_seqs": 4})
    assert llm.engine.pooling_config == PoolingConfig(method, True, False, True)
    tok = llm.get_tokenizer()
    first = llm.embed(TEXTS, use_tqdm=False)
    again = llm.embed(TEXTS, use_tqdm=False)  # every row is needed: never from the prefix cache
    for i, t in enumerate(TEXTS):
        want = reference_embedding(path, tok.encode(t), method)
        assert_close(first[i], want)
        assert_close(again[i], want)
    assert_all_blocks_free(llm)


def test_an_embedding_model_precompiles_its_pool_steps(qwen3, tmp_path, monkeypatch):
    """A model with sentence-transformers files is an embedding model: start-up compiles the pool
    variant of every bucket its pooling rows can use (W = 0), so no request waits on a compile."""
    llm = LLM(with_pooling(qwen3, tmp_path / "st", "lasttoken"), use_tqdm=False, **ENGINE_KW)
    asked = []
    monkeypatch.setattr(llm.engine.runner, "precompile", lambda progress=None, keys=None: asked.append(keys) or 0.0)
    llm.engine.precompile()
    buckets = llm.engine.runner.all_buckets()
    assert asked[0] is None  # every plain bucket
    assert sorted(asked[1]) == sorted(k._replace(pool=True) for k in buckets if not k.w) and asked[1]


def test_unnormalised_and_dimensions(llm, qwen3, tmp_path):
    ids = llm.get_tokenizer().encode(TEXTS[0])
    raw = llm.embed(TEXTS[0], normalize=False, use_tqdm=False)[0]
    np.testing.assert_allclose(raw, hidden_states(qwen3, ids)[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="dimensions") as e:
        llm.embed(TEXTS[0], dimensions=8, use_tqdm=False)
    assert e.value.param == "dimensions"
    path = tmp_path / "mrl"
    shutil.copytree(qwen3, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    assert PoolingConfig.from_model(path).matryoshka
    p = PoolingConfig.from_model(path).params(8, 64)
    assert p.dimensions == 8 and p.normalize
    with pytest.raises(UserError, match="from 1 to 64"):
        PoolingConfig.from_model(path).params(65, 64)


def test_rerank_scores_equal_transformers(llm, qwen3):
    tok = llm.get_tokenizer()
    query, docs = "capital of France", ["Paris is the capital of France.", "JAX is a library", "def add(a, b)"]
    got = llm.score(query, docs, use_tqdm=False)
    tokens = [tok.encode(t, add_special_tokens=False)[0] for t in SCORE_TOKENS.split(",")]
    want = [reference_score(qwen3, pair_prompt(tok, query, d), tokens) for d in docs]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(0 <= s <= 1 for s in got) and len(set(got)) == len(got)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # an LM head of its own; tied to the embeddings
def test_score_head_is_the_lm_head_columns_of_the_answer_tokens(tiny_model, arch):
    from jaxserve.model.loader import load_model
    from jaxserve.pooling import score_head
    from jaxserve.tokenizer import Tokenizer

    path = tiny_model(arch)
    lm = load_model(path)
    tok = Tokenizer.from_pretrained(path)
    head = score_head(lm.params, lm.config, tok, SCORE_TOKENS)
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in SCORE_TOKENS.split(",")]
    want = _hf_model(path).get_output_embeddings().weight.detach().numpy()[ids].T
    assert lm.config.tie_word_embeddings == (arch == "qwen2")
    np.testing.assert_array_equal(head, want)
    assert "score-tokens" in score_head(lm.params, lm.config, tok, "no,yes")  # not single tokens here


def test_rerank_needs_single_token_answers(tiny_llm):
    with pytest.raises(UserError, match="score-tokens"):
        tiny_llm.score("q", ["d"], use_tqdm=False)  # 'no' and 'yes' are not tokens of the tiny vocabulary
    assert_all_blocks_free(tiny_llm)
