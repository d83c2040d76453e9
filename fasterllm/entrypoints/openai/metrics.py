"""Prometheus metrics of the server, in a registry of its own (several apps can live in one process). Where
PROMETHEUS_MULTIPROC_DIR is set (several API server processes, api_servers.py), each process writes its values
there and /metrics adds up every process's."""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from fasterllm.engine.engine_stats import EngineStats
from fasterllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)

# what became of an HTTP request: "success", "rejected" (4xx), "error" (5xx), "aborted" (client gone)
OUTCOMES = ("success", "rejected", "error", "aborted")


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        r = self.registry
        engine_gauge = {"registry": r, "multiprocess_mode": "mostrecent"}  # every process sets the engine's latest
        self.requests = Counter("fasterllm_requests", "HTTP requests to /v1 endpoints by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every series exists from the start, at 0
        self.prompt_tokens = Counter("fasterllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fasterllm_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.time_to_first_token = Histogram("fasterllm_time_to_first_token_seconds",
                                             "From arrival to the first generated token", registry=r,
                                             buckets=_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram("fasterllm_time_per_output_token_seconds",
                                               "Mean time between generated tokens of a one-sample request",
                                               registry=r, buckets=_LATENCY_BUCKETS)
        self.running = Gauge("fasterllm_num_requests_running", "Requests in the running batch", **engine_gauge)
        self.waiting = Gauge("fasterllm_num_requests_waiting", "Requests waiting to be scheduled", **engine_gauge)
        self.kv_cache_usage = Gauge("fasterllm_kv_cache_usage_ratio", "Fraction of KV blocks held by requests",
                                    **engine_gauge)
        self.kv_blocks_in_use = Gauge("fasterllm_kv_cache_blocks_in_use", "KV blocks held by requests", **engine_gauge)
        self.kv_blocks = Gauge("fasterllm_kv_cache_blocks", "KV blocks in the pool", **engine_gauge)

    def record_finished(self, output: RequestOutput) -> None:
        """Tokens and latencies of one finished engine request (all its parallel samples)."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.generation_tokens.inc(num_generated)
        m = output.metrics
        if m is None or m.first_token_time is None:
            return
        self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        # the timestamps are the first sample's; parallel samples (n > 1) are left out of this one
        time_per_token = m.time_per_output_token(len(output.outputs[0].token_ids))
        if len(output.outputs) == 1 and time_per_token is not None:
            self.time_per_output_token.observe(time_per_token)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text format, with the engine gauges read from its latest stats."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_blocks_in_use.set(round(stats.kv_cache_usage * stats.num_kv_blocks))
        self.kv_blocks.set(stats.num_kv_blocks)
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, path=self._multiprocess_dir)
        return generate_latest(every_process)
