"""Prometheus metrics named like vLLM's (``vllm:`` → ``tgengine:``), so dashboards carry over.

``ServerConfig.metrics_prefix="vllm"`` serves them under vLLM's own names, so an existing
vLLM Grafana dashboard works unchanged. Gauges and counters are read from
``engine.stats()`` at scrape time (a custom collector, nothing to keep in sync); the
latency histograms are observed by the server per HTTP request, and the per-request and
per-step histograms by an observer of the engine. Each app has its own
``CollectorRegistry``: tests start many servers in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.client import EngineClient
from ..engine.request_stats import RequestStats, StepStats

FINISH_REASONS = ("stop", "length", "abort", "error")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
PHASE_BUCKETS = E2E_BUCKETS


class EngineCollector(Collector):
    """Gauges and counters from one ``engine.stats()`` snapshot per scrape."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def describe(self) -> Iterable[Metric]:
        return []  # not known until scraped; keeps registration free of side effects

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        name = [self.model_name]
        p = self.prefix

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{p}:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{p}:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to run.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100%.", stats.kv_cache_usage)
        usage = stats.kv_cache_usage
        yield gauge("gpu_cache_usage_perc", "Older name of kv_cache_usage_perc.", usage)
        yield gauge("weight_version", "Weight updates applied so far.", stats.weight_version)
        sleep = GaugeMetricFamily(
            f"{p}:engine_sleep_state",
            "1 for the current sleep state (awake, weights_offloaded, discard_all).",
            labels=["model_name", "sleep_state"],
        )
        current = self._sleep_state()
        for state in SLEEP_STATES:
            sleep.add_metric([self.model_name, state], 1.0 if state == current else 0.0)
        yield sleep
        yield self._cache_config_info(stats.num_total_blocks)
        yield counter("prompt_tokens", "Prefill tokens admitted.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("num_preemptions", "Preemptions.", stats.num_preemptions_total)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_total,
        )
        hits = stats.prefix_cache_hits_total
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        restarts = stats.num_restarts_total
        yield counter("engine_restarts", "Engine processes started after a death.", restarts)
        success = CounterMetricFamily(
            f"{p}:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        reasons = dict.fromkeys(FINISH_REASONS, 0) | stats.finished_total
        for reason, count in sorted(reasons.items()):
            success.add_metric([self.model_name, reason], count)
        yield success

    def _cache_config_info(self, num_blocks: int) -> GaugeMetricFamily:
        config = self.engine.config
        labels = {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": str(config.dtype),
        }
        name, doc = f"{self.prefix}:cache_config_info", "KV cache configuration."
        info = GaugeMetricFamily(name, doc, labels=list(labels))
        info.add_metric(list(labels.values()), 1.0)
        return info

    def _sleep_state(self) -> str:
        if not self.engine.is_sleeping:
            return "awake"
        memory = self.engine.memory_stats().values()
        return "weights_offloaded" if any(m.host_weights_bytes for m in memory) else "discard_all"


class ServerMetrics:
    """The registry of one app: the engine collector and the histograms."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str = "tgengine") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_name, prefix))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                f"{prefix}:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
            )
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of one request.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Older name of inter_token_latency.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last chunk.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", PHASE_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", PHASE_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", PHASE_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", PHASE_BUCKETS
        )
        self.time_per_output_token_request = histogram(
            "request_time_per_output_token_seconds", "Decode time per generated token.", ITL_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS
        )
        self.max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of the longest sequence of a request.",
            TOKEN_BUCKETS,
        )
        self.params_n = histogram("request_params_n", "The n parameter of requests.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter of requests.", TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt and generated tokens of the outputs of one engine step.",
            TOKEN_BUCKETS,
        )
        engine.observers.append(self)

    def request_finished(self, stats: RequestStats) -> None:
        """Observe one finished request (an ``EngineObserver`` callback)."""
        self.prompt_tokens.observe(stats.num_prompt_tokens)
        self.generation_tokens.observe(stats.num_generation_tokens)
        self.max_num_generation_tokens.observe(stats.max_num_generation_tokens)
        self.params_n.observe(stats.n)
        self.params_max_tokens.observe(stats.max_tokens)
        scheduled, first, last = stats.scheduled_time, stats.first_token_time, stats.last_token_time
        if scheduled is None:
            return
        self.queue_time.observe(scheduled - stats.arrival_time)
        if first is None or last is None:
            return
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)
        if stats.max_num_generation_tokens > 1:
            self.time_per_output_token_request.observe(
                (last - first) / (stats.max_num_generation_tokens - 1)
            )

    def step_finished(self, stats: StepStats) -> None:
        """Observe one engine step (an ``EngineObserver`` callback), as vLLM does: the
        prompt and generated tokens of its outputs; a step without output (a prompt chunk
        that samples nothing) is not an iteration there."""
        if stats.num_generation_tokens:
            self.iteration_tokens.observe(stats.num_iteration_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
