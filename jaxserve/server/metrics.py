"""Prometheus metrics in the `jaxserve:` namespace, named after vLLM's.

Engine-wide numbers (running/waiting, KV usage, prefix cache, preemptions, token counts) come from
the stats snapshot the engine thread publishes after each step, read by a custom collector at
scrape time; per-request latencies are histograms observed as outputs arrive. Each app has its own
registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.outputs import RequestOutput

NS = "jaxserve:"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self):
        st = self._stats()
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(NS + name, doc, labels=labels)
            g.add_metric([self._model], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(NS + name, doc, labels=labels)
            c.add_metric([self._model], float(value))
            return c

        usable = max(st.get("num_blocks", 1) - 1, 1)  # block 0 is the null block
        yield gauge(
            "num_requests_running", "Sequences in the running batch.", st.get("num_running", 0)
        )
        yield gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled.", st.get("num_waiting", 0)
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks held by requests (1 = full).",
            st.get("blocks_used", 0) / usable,
        )
        yield counter(
            "prefix_cache_queries", "Prefix cache lookups.", st.get("prefix_cache_queries", 0)
        )
        yield counter(
            "prefix_cache_hits", "Prefix cache lookups that hit.", st.get("prefix_cache_hits", 0)
        )
        yield counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", st.get("preemptions", 0)
        )
        yield counter("prompt_tokens", "Prompt tokens admitted.", st.get("prompt_tokens", 0))
        yield counter("generation_tokens", "Tokens generated.", st.get("generation_tokens", 0))
        if "spec_verifications" in st:  # speculative decoding (vLLM's names)
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


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        kw = {"labelnames": ["model_name"], "registry": self.registry}
        self.success = Counter(
            NS + "request_success",
            "Finished requests (choices) by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            NS + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)
        self.itl = Histogram(
            NS + "inter_token_latency_seconds",
            "Time between consecutive output steps.",
            buckets=_ITL_BUCKETS,
            **kw,
        ).labels(model_name)
        self.e2e = Histogram(
            NS + "e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, **kw
        ).labels(model_name)
        self.queue = Histogram(
            NS + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            **kw,
        ).labels(model_name)
        self._model = model_name
        self._last_token: dict[str, float] = {}

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
                self.success.labels(self._model, o.finish_reason or "abort").inc()

    def aborted(self, request_id: str, num_choices: int) -> None:
        self._last_token.pop(request_id, None)
        self.success.labels(self._model, "abort").inc(num_choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)
