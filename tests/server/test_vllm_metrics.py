"""vLLM's /metrics contract, as routers (SMG, llm-d, the Gateway API Inference Extension) and
dashboards read it: names, types, units, labels and buckets, parsed with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server.metrics import VLLM_ITL_BUCKETS, VLLM_REQUEST_BUCKETS, VLLM_TTFT_BUCKETS

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # vLLM's lists, written out, not imported
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
       40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
           240.0, 480.0, 960.0, 1920.0, 7680.0]


def families(http) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def value(fams, name: str, suffix: str = "") -> float:
    (s,) = [s for s in fams[name].samples if s.name == name + suffix]
    return s.value


def test_bucket_lists_are_vllms():
    assert list(VLLM_TTFT_BUCKETS) == TTFT
    assert list(VLLM_ITL_BUCKETS) == ITL
    assert list(VLLM_REQUEST_BUCKETS) == REQUEST


def test_vllm_names_types_labels_and_units(server, http, client):
    server.wait_idle()
    before = families(http)
    prompt = "the quick brown fox jumps over the lazy dog " * 6  # several full 16-token blocks
    for _ in range(2):  # the second lookup hits the blocks the first one cached
        chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                                temperature=0, stream=True))
        assert chunks
    server.wait_idle()
    after = families(http)
    model = server.model

    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        fam = after[name]
        assert fam.type == "gauge", name
        (s,) = fam.samples
        assert s.labels == {"model_name": model, "engine": "0"}, s.labels
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert value(after, "vllm:num_requests_running") == 0

    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:num_preemptions"):
        assert after[name].type == "counter", name
        assert after[name].samples[0].name == name + "_total"
    # Units are tokens, as vLLM's: two lookups of the same prompt query 2 x its tokens and the
    # second hits its full blocks (a multiple of the block size), not "1 hit".
    prompt_tokens = value(after, "vllm:prompt_tokens", "_total") - value(before, "vllm:prompt_tokens", "_total")
    queries = value(after, "vllm:prefix_cache_queries", "_total") - value(before, "vllm:prefix_cache_queries", "_total")
    hits = value(after, "vllm:prefix_cache_hits", "_total") - value(before, "vllm:prefix_cache_hits", "_total")
    assert queries == prompt_tokens and queries >= 2 * 48, (queries, prompt_tokens)
    assert hits >= 48 and hits % 16 == 0, hits

    info = after["vllm:cache_config_info"]
    assert info.type == "gauge"
    (s,) = info.samples
    assert s.value == 1.0
    assert s.labels["block_size"] == "16" and s.labels["enable_prefix_caching"] == "True"
    assert int(s.labels["num_gpu_blocks"]) == 256 and s.labels["engine"] == "0"

    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT),
                          ("vllm:inter_token_latency_seconds", ITL),
                          ("vllm:e2e_request_latency_seconds", REQUEST),
                          ("vllm:request_queue_time_seconds", REQUEST)):
        fam = after[name]
        assert fam.type == "histogram", name
        les = [float(s.labels["le"]) for s in fam.samples if s.name == name + "_bucket"]
        assert les == [*buckets, float("inf")], name
        assert all(s.labels["model_name"] == model and s.labels["engine"] == "0" for s in fam.samples)
        grew = value(after, name, "_count") - value(before, name, "_count")
        assert grew >= (2 if name != "vllm:inter_token_latency_seconds" else 1), name

    success = after["vllm:request_success"]
    assert success.type == "counter"
    stops = [s for s in success.samples if s.name == "vllm:request_success_total"]
    assert {"model_name", "engine", "finished_reason"} == set(stops[0].labels)
    # jaxserve's own names stay beside them
    assert "jaxserve:kv_cache_usage_perc" in after and "jaxserve:time_to_first_token_seconds" in after
