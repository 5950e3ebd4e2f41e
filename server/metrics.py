"""Prometheus metrics of one server (one registry per app, so several apps in one process —
tests — never collide). Slot and queue gauges are read from `engine.stats()` at scrape time, and so
are, on an engine that speculates, the acceptance rate and mean accepted length, and on an engine with a
prefix cache (runtime/prefix_cache.py) its counters: onegraph_prefix_cache_queried_tokens_total,
_hit_tokens_total, _evictions_total, and its gauges _entries, _bytes, _budget_bytes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("onegraph_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("onegraph_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("onegraph_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("onegraph_request_finished", "finished generations by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("onegraph_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("onegraph_time_per_output_token_seconds", "mean time between output tokens "
                              "of one request", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("onegraph_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        Gauge("onegraph_active_slots", "engine slots holding a request", registry=r).set_function(
            lambda: engine.stats()["active_slots"])
        Gauge("onegraph_queue_depth", "requests waiting for a slot", registry=r).set_function(
            lambda: engine.stats()["queue_depth"])
        Gauge("onegraph_max_slots", "engine slots", registry=r).set_function(lambda: engine.stats()["max_slots"])
        Gauge("onegraph_prefill_budget_tokens", "prompt tokens prefilled per engine step", registry=r).set_function(
            lambda: engine.stats().get("prefill_budget", 0))
        if getattr(engine, "spec", 0):          # speculative decoding (runtime/engine.py): since the engine started
            def spec(key):
                return lambda: (engine.stats()["speculation"] or {}).get(key, 0.0)
            Gauge("onegraph_spec_acceptance_rate", "speculative decoding: accepted drafts / drafted tokens",
                  registry=r).set_function(spec("acceptance_rate"))
            Gauge("onegraph_spec_mean_accepted_length", "speculative decoding: tokens per round (accepted drafts "
                  "+ 1)", registry=r).set_function(spec("mean_accepted_length"))
            Gauge("onegraph_spec_rounds", "speculative decoding: rounds (draft + verify steps) read",
                  registry=r).set_function(spec("rounds"))
            Gauge("onegraph_spec_draft_tokens", "speculative decoding: drafts per round (export "
                  "--speculative-tokens)", registry=r).set_function(spec("tokens"))

        if getattr(engine, "cache", None) is not None:
            r.register(_PrefixCacheCollector(engine))

    def observe_generation(self, prompt_tokens: int, tokens: int, t_start: float, t_first: float | None,
                           t_last: float | None, finish_reason: str):
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        self.finished.labels(finish_reason).inc()
        if t_first is not None:
            self.ttft.observe(t_first - t_start)
            self.e2e.observe((t_last or t_first) - t_start)
            if tokens > 1 and t_last is not None:
                self.tpot.observe((t_last - t_first) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's counters since the engine started (Engine.stats()["prefix_cache"]), read at scrape."""

    COUNTERS = (("queried_tokens", "prompt tokens looked up in the prefix cache"),
                ("hit_tokens", "prompt tokens the prefix cache supplied (not prefilled)"),
                ("evictions", "prefix cache blocks evicted (LRU) to store others"))
    GAUGES = (("entries", "prefix cache blocks held"), ("bytes", "bytes of the prefix cache blocks held"),
              ("budget_bytes", "bytes of the prefix cache's pool"))

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        st = self.engine.stats()["prefix_cache"]
        for key, doc in self.COUNTERS:
            yield CounterMetricFamily(f"onegraph_prefix_cache_{key}", doc, value=st[key])
        for key, doc in self.GAUGES:
            yield GaugeMetricFamily(f"onegraph_prefix_cache_{key}", doc, value=st[key])
