"""Prometheus metrics: jaxserve's own `jaxserve:` names and vLLM's `vllm:` contract beside them.

Engine-wide numbers (running/waiting, KV usage, prefix cache, preemptions, token counts) come from
the stats snapshot the engine thread publishes after each step, read by a custom collector at
scrape time; per-request latencies are histograms observed as outputs arrive. Each app has its own
registry, so several servers can live in one process (tests).

The `vllm:` series are what routers read (SMG's cache-aware policy takes a worker's load from
`vllm:kv_cache_usage_perc`, `vllm:num_requests_running`/`waiting`; llm-d and the Gateway API
Inference Extension read the same): vLLM V1's names, types, units (KV usage 0-1, prefix-cache
queries/hits in tokens), labels (`model_name`, `engine`) and histogram buckets.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.outputs import RequestOutput

NS = "jaxserve:"
VLLM = "vllm:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM V1's buckets (vllm/v1/metrics/loggers.py): its ITL/TPOT and request-latency series.
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_TTFT_BUCKETS = _LATENCY_BUCKETS  # the same list in vLLM
_ITL_BUCKETS = (0.001, 0.0025, 0.005, *VLLM_ITL_BUCKETS)
ENGINE_INDEX = "0"  # one engine per replica; vLLM's `engine` label
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: str, cache_info: dict[str, str]):
        self._stats = stats
        self._model = model_name
        self._cache_info = cache_info

    def collect(self):
        st = self._stats()
        usable = max(st.get("num_blocks", 1) - 1, 1)  # block 0 is the null block
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", st.get("num_running", 0)),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", st.get("num_waiting", 0)),
            ("kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by requests (1 = full).",
             st.get("blocks_used", 0) / usable),
        )
        counters = (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             st.get("prefix_cache_queries", 0)),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             st.get("prefix_cache_hits", 0)),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", st.get("preemptions", 0)),
            ("prompt_tokens", "Prompt tokens admitted.", st.get("prompt_tokens", 0)),
            ("generation_tokens", "Tokens generated.", st.get("generation_tokens", 0)),
        )
        for ns, labels, values in ((NS, ["model_name"], [self._model]),
                                   (VLLM, ["model_name", "engine"], [self._model, ENGINE_INDEX])):
            for name, doc, value in gauges:
                g = GaugeMetricFamily(ns + name, doc, labels=labels)
                g.add_metric(values, float(value))
                yield g
            for name, doc, value in counters:
                c = CounterMetricFamily(ns + name, doc, labels=labels)
                c.add_metric(values, float(value))
                yield c
        info = GaugeMetricFamily(VLLM + "cache_config_info", "Information of the engine's cache config.",
                                 labels=[*self._cache_info, "engine"])
        info.add_metric([*self._cache_info.values(), ENGINE_INDEX], 1.0)
        yield info
        if "spec_verifications" in st:  # speculative decoding (vLLM's names)
            labels = ["model_name"]

            def counter(name, doc, value):
                c = CounterMetricFamily(NS + name, doc, labels=labels)
                c.add_metric([self._model], float(value))
                return c

            yield counter("spec_decode_num_drafts", "Draft runs verified (one per sequence and step).",
                          st["spec_verifications"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", st["spec_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          st["spec_accepted_tokens"])
            counts = st["spec_acceptance_counts"]  # by accepted drafts: tokens per step = n + 1
            h = HistogramMetricFamily(NS + "spec_decode_acceptance_length",
                                      "Tokens emitted per verification (accepted drafts + 1).", labels=labels)
            cum, buckets = 0, []
            for n, c in enumerate(counts):
                cum += c
                buckets.append((str(float(n + 1)), cum))
            buckets.append(("+Inf", cum))
            h.add_metric([self._model], buckets, sum_value=float(sum((n + 1) * c for n, c in enumerate(counts))))
            yield h


class _Series:
    """One latency/count series under both namespaces: jaxserve's buckets and vLLM's."""

    def __init__(self, registry, model: str, name: str, doc: str, ours, theirs) -> None:
        self._h = (
            Histogram(NS + name, doc, labelnames=["model_name"], buckets=ours, registry=registry).labels(model),
            Histogram(VLLM + name, doc, labelnames=["model_name", "engine"], buckets=theirs,
                      registry=registry).labels(model, ENGINE_INDEX),
        )

    def observe(self, value: float) -> None:
        for h in self._h:
            h.observe(value)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], model_name: str, cache_info: dict[str, str] | None = None):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(stats, model_name, cache_info or {}))
        self._success = (
            Counter(NS + "request_success", "Finished requests (choices) by finish reason.",
                    labelnames=["model_name", "finished_reason"], registry=r),
            Counter(VLLM + "request_success", "Count of successfully processed requests.",
                    labelnames=["model_name", "engine", "finished_reason"], registry=r),
        )
        self.ttft = _Series(r, model_name, "time_to_first_token_seconds", "Time to first token.",
                            _LATENCY_BUCKETS, VLLM_TTFT_BUCKETS)
        self.itl = _Series(r, model_name, "inter_token_latency_seconds",
                           "Time between consecutive output steps.", _ITL_BUCKETS, VLLM_ITL_BUCKETS)
        self.e2e = _Series(r, model_name, "e2e_request_latency_seconds", "Arrival to finish.",
                           _LATENCY_BUCKETS, VLLM_REQUEST_BUCKETS)
        self.queue = _Series(r, model_name, "request_queue_time_seconds", "Arrival to first scheduled.",
                             _LATENCY_BUCKETS, VLLM_REQUEST_BUCKETS)
        self._model = model_name
        self._last_token: dict[str, float] = {}

    def _succeeded(self, reason: str, n: int = 1) -> None:
        self._success[0].labels(self._model, reason).inc(n)
        self._success[1].labels(self._model, ENGINE_INDEX, reason).inc(n)

    def observe(self, out: RequestOutput) -> None:
        """Called (on the event loop) for every output the engine delivers."""
        m = out.metrics
        if m is None:
            return
        rid = out.request_id
        if any(o.delta_token_ids for o in out.outputs) and m.last_token_time is not None:
            prev = self._last_token.get(rid)
            if prev is None:
                if m.first_token_time is not None:
                    self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
            elif m.last_token_time > prev:
                self.itl.observe(m.last_token_time - prev)
            self._last_token[rid] = m.last_token_time
        if out.finished:
            self._last_token.pop(rid, None)
            self.e2e.observe(max((m.finished_time or time.time()) - m.arrival_time, 0.0))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            for o in out.outputs:
                self._succeeded(o.finish_reason or "abort")

    def aborted(self, request_id: str, num_choices: int) -> None:
        self._last_token.pop(request_id, None)
        self._succeeded("abort", num_choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cache_config_info(config, num_blocks: int) -> dict[str, str]:
    """Labels of `vllm:cache_config_info` (vLLM's CacheConfig field names) from an EngineConfig."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(config.kv_cache_dtype or "auto"),
        "enable_prefix_caching": str(config.prefix_cache != "off"),
        "prefix_caching_hash_algo": "blake2b" if config.prefix_cache == "hash" else str(config.prefix_cache),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(num_blocks),
    }
