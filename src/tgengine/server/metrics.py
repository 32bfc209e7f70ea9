"""Prometheus metrics named like vLLM's (``vllm:`` → ``tgengine:``), so dashboards carry over.

Gauges and counters are read from ``engine.stats()`` at scrape time (a custom collector,
nothing to keep in sync); the latency histograms are observed by the server per request.
Each app has its own ``CollectorRegistry``: tests start many servers in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine import Engine

FINISH_REASONS = ("stop", "length", "abort", "error")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineCollector(Collector):
    """Gauges and counters from one ``engine.stats()`` snapshot per scrape."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        return []  # not known until scraped; keeps registration free of side effects

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"tgengine:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"tgengine:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to run.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100%.", stats.kv_cache_usage)
        yield gauge("weight_version", "Weight updates applied so far.", stats.weight_version)
        sleep = GaugeMetricFamily(
            "tgengine:engine_sleep_state",
            "1 for the current sleep state (awake, weights_offloaded, discard_all).",
            labels=["model_name", "sleep_state"],
        )
        current = self._sleep_state()
        for state in SLEEP_STATES:
            sleep.add_metric([self.model_name, state], 1.0 if state == current else 0.0)
        yield sleep
        yield counter("prompt_tokens", "Prefill tokens admitted.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("num_preemptions", "Preemptions.", stats.num_preemptions_total)
        success = CounterMetricFamily(
            "tgengine:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        reasons = dict.fromkeys(FINISH_REASONS, 0) | stats.finished_total
        for reason, count in sorted(reasons.items()):
            success.add_metric([self.model_name, reason], count)
        yield success

    def _sleep_state(self) -> str:
        if not self.engine.is_sleeping:
            return "awake"
        memory = self.engine.memory_stats().values()
        return "weights_offloaded" if any(m.host_weights_bytes for m in memory) else "discard_all"


class ServerMetrics:
    """The registry of one app: the engine collector and the per-request histograms."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "tgengine:time_to_first_token_seconds",
            "Time from the request's arrival to its first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "tgengine:inter_token_latency_seconds",
            "Time between two tokens of one request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "tgengine:e2e_request_latency_seconds",
            "Time from the request's arrival to its last chunk.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
