"""`dflash serve`'s Prometheus metrics (GET /metrics), in their own registry.

prometheus_client writes the text exposition format (escaping, histogram buckets with `_sum` and `_count`) that
Prometheus and Grafana scrape; vLLM and SGLang export theirs the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(
        self,
        *,
        model: str,
        speculative: bool,
        block_size: int,
        waiting: Callable[[], int],
        running: Callable[[], int],
        batch_size: int = 1,
    ) -> None:
        disable_created_metrics()  # no `_created` timestamp series beside every counter: noise on a dashboard
        self.registry = registry = CollectorRegistry()
        info = Gauge(
            "dflash_model_info",
            "The served model (value 1)",
            ["model", "speculative", "block_size", "batch_size"],
            registry=registry,
        )
        info.labels(model, str(speculative).lower(), str(block_size), str(batch_size)).set(1)
        self.http = Counter(
            "dflash_http_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=registry,
        )
        self.finished = Counter(
            "dflash_requests_finished",
            "Generations ended, by finish reason (stop, length, cancelled: client gone or shutdown, error)",
            ["finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of generations", registry=registry)
        self.prefix_hits = Counter(
            "dflash_prefix_cache_hits", "Generations that reused a prefix a slot held (prefix reuse)", registry=registry
        )
        self.prefix_misses = Counter(
            "dflash_prefix_cache_misses", "Generations that prefilled their whole prompt", registry=registry
        )
        self.cached_tokens = Counter(
            "dflash_prefix_cache_reused_tokens", "Prompt tokens reused from a slot, not prefilled", registry=registry
        )
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", registry=registry)
        Gauge("dflash_queue_depth", "Requests waiting for the engine", registry=registry).set_function(waiting)
        Gauge("dflash_requests_running", "Requests being decoded (rows of the batch)", registry=registry).set_function(
            running
        )
        self.batch_rows = Histogram(
            "dflash_batch_rows",
            "Rows that shared each verify step (continuous batching)",
            buckets=ROWS_BUCKETS,
            registry=registry,
        )
        self.tau = Histogram(
            "dflash_tau",
            "Mean tokens committed per verify step, one sample per request (DFlash only; 1 = no gain)",
            buckets=TAU_BUCKETS,
            registry=registry,
        )
        self.acceptance = Histogram(
            "dflash_acceptance_length",
            "Tokens committed per verify step, bonus token included (DFlash only): the acceptance histogram",
            buckets=tuple(range(1, max(block_size, 1) + 1)),
            registry=registry,
        )
        self.tpot = Histogram(
            "dflash_time_per_output_token_seconds",
            "Decode time per token after the first, per request",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds",
            "Prefill until the first token (queue wait excluded)",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "dflash_queue_wait_seconds",
            "Time a request waited for the engine",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )

    def answered(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def generation_ended(self, finish_reason: str, stats: Any, queue_wait: float) -> None:
        """One generation's numbers (`stats`: engine GenerationStats, None when it never started)."""
        self.finished.labels(finish_reason).inc()
        self.queue_wait.observe(queue_wait)
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        (self.prefix_hits if stats.cached_tokens else self.prefix_misses).inc()
        self.cached_tokens.inc(stats.cached_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        if stats.generated_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.generated_tokens > 1 and stats.decode_s > 0:
            self.tpot.observe(stats.decode_s / (stats.generated_tokens - 1))
        if stats.speculative and stats.acceptance_lengths:
            self.tau.observe(stats.tau)
            for length in stats.acceptance_lengths:
                self.acceptance.observe(length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
