"""POST /v1/embeddings, /v1/rerank and /v1/score on a real server over a tiny random Qwen3 (with
sentence-transformers files and a Matryoshka flag): the official `openai` client's
embeddings.create unmodified (float and base64), vectors and scores equal to transformers, one
400 naming the field for each bad input, and no KV block left behind."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import ServerThread
from tests.server.sdk_types import aborted
from tests.test_pooling import SCORE_TOKENS, assert_close, reference_embedding, reference_score, with_pooling

TEXTS = ["The capital of France is Paris.", "JAX is a library for array computation.", "a"]
QUERY = "capital of France"
DOCS = ["Paris is the capital of France.", "def add(a, b):\n    return a + b\n", "Rome, Italy"]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    path = with_pooling(tiny_model("qwen3"), tmp_path_factory.mktemp("embed") / "qwen3-embed", "lasttoken")
    cfg = json.loads(open(f"{path}/config.json").read())
    with open(f"{path}/config.json", "w") as f:
        json.dump({**cfg, "is_matryoshka": True}, f)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(model_dir):
    s = ServerThread(model_dir, {"score_tokens": SCORE_TOKENS}, precompile=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(srv):
    return srv.engine.tokenizer


def test_openai_client_embeddings_float_and_base64(srv, model_dir, tok):
    client = srv.client()
    want = [reference_embedding(model_dir, tok.encode(t), "last") for t in TEXTS]
    for fmt in ("float", "base64", openai.NOT_GIVEN):  # the client asks for base64 when not told
        r = client.embeddings.create(model=srv.model, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in r.data] == [0, 1, 2] and r.model == srv.model
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)
        for d, w in zip(r.data, want):
            vec = d.embedding  # the client decodes base64 only when it chose it itself
            vec = np.frombuffer(base64.b64decode(vec), "<f4") if fmt == "base64" else np.asarray(vec, np.float32)
            assert_close(vec, w)
    one = client.embeddings.create(model=srv.model, input=tok.encode(TEXTS[0]), user="u1")  # token ids
    assert len(one.data) == 1
    assert_close(np.asarray(one.data[0].embedding, np.float32), want[0])


def test_raw_base64_and_dimensions(srv, model_dir, tok):
    with srv.http() as http:
        r = http.post("/v1/embeddings", json={"input": [tok.encode(TEXTS[1])], "encoding_format": "base64",
                                              "dimensions": 16})
    assert r.status_code == 200, r.text
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    full = reference_embedding(model_dir, tok.encode(TEXTS[1]), "last")
    assert vec.shape == (16,)
    assert_close(vec, full[:16] / np.linalg.norm(full[:16]))


def test_rerank_and_score_equal_transformers(srv, model_dir, tok):
    from jaxserve.rerank import pair_prompt

    ids = [tok.encode(t, add_special_tokens=False)[0] for t in SCORE_TOKENS.split(",")]
    want = [reference_score(model_dir, pair_prompt(tok, QUERY, d), ids) for d in DOCS]
    with srv.http() as http:
        r = http.post("/v1/rerank", json={"model": srv.model, "query": QUERY,
                                          "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]]})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -want[i])
        for x in results:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5 and 0 <= x["relevance_score"] <= 1
            assert x["document"] == {"text": DOCS[x["index"]]}
        assert body["usage"]["total_tokens"] == sum(len(pair_prompt(tok, QUERY, d)) for d in DOCS)
        top = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                            "return_documents": False}).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in results[:2]]
        assert all("document" not in x for x in top)
        s = http.post("/v1/score", json={"model": srv.model, "text_1": QUERY, "text_2": DOCS})
        assert s.status_code == 200, s.text
        assert [d["index"] for d in s.json()["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in s.json()["data"]], want, atol=1e-5)
        pairwise = http.post("/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
        np.testing.assert_allclose([d["score"] for d in pairwise["data"]], want[:2], atol=1e-5)
        for alias in ("/rerank", "/v2/rerank"):  # vLLM's aliases, the same handler
            r = http.post(alias, json={"query": QUERY, "documents": DOCS}).json()["results"]
            assert [x["index"] for x in r] == [x["index"] for x in results]
            np.testing.assert_allclose([x["relevance_score"] for x in r], [want[x["index"]] for x in r], atol=1e-5)
        alias = http.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()["data"]
        np.testing.assert_allclose([d["score"] for d in alias], want, atol=1e-5)


TOO_LONG = list(range(5, 300))  # max_model_len is 256
BAD = [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": [TOO_LONG]}, "input"),
    ("/v1/embeddings", {"input": [[1, 10**7]]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "pooling": "mean"}, "pooling"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": 1, "documents": ["d"]}, "query"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "d"}]}, "documents[0]"),
    ("/v1/rerank", {"query": "q", "documents": ["d " * 300]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "rank_fields": ["a"]}, "rank_fields"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "encoding_format": "float"}, "encoding_format"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.rsplit('/', 1)[1]}-{w}" for p, _, w in BAD])
def test_bad_input_is_one_400_naming_the_field(srv, path, body, param):
    with srv.http() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert param.split("[")[0] in err["message"] or param in err["param"]


def test_unknown_model_is_404(srv):
    with pytest.raises(openai.NotFoundError):
        srv.client().embeddings.create(model="nope", input="x")


def test_a_client_that_leaves_aborts_every_input(srv):
    """Queued behind a paused engine, the call's client gives up: its inputs are aborted."""
    before = aborted(srv)
    long_inputs = [[7 + (i + j) % 200 for j in range(240)] for i in range(3)]  # 4 chunks each
    with srv.paused(), httpx.Client(base_url=srv.url, timeout=0.5) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/embeddings", json={"input": long_inputs})
    assert srv.wait_idle()["blocks_used"] == 0
    assert aborted(srv) == before + 3


def test_nothing_leaks(srv):
    stats = srv.wait_idle()
    assert stats["blocks_used"] == 0, stats
    srv.on_engine(lambda e: e.scheduler.kv.check_invariants())
