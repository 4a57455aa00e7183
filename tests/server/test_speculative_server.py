"""A server with speculative decoding (real uvicorn, official client): the same greedy text as
without it, streamed and whole, and vLLM's spec_decode metrics on /metrics."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerThread
from tests.test_speculative import NGRAM

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="module")
def spec_server(tiny_llama):
    s = ServerThread(tiny_llama, {"speculative_config": NGRAM})
    yield s
    s.stop()


def test_speculative_server_answers_as_the_plain_one(server, client, spec_server):
    kw = dict(prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(model=server.model, **kw).choices[0].text
    c = spec_server.client()
    assert c.completions.create(model=spec_server.model, **kw).choices[0].text == want
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=spec_server.model, stream=True, **kw))
    assert streamed == want
    with spec_server.http() as h:
        text = h.get("/metrics").text
    drafts = next(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("jaxserve:spec_decode_num_draft_tokens_total"))
    assert drafts > 0
    assert "jaxserve:spec_decode_acceptance_length_bucket" in text
    spec_server.wait_idle()
