"""Prometheus metrics of a guarded engine, in a registry of their own (one per server).

    metrics = ServingMetrics(guard)
    result = guard.run(feeds); metrics.observe(result, seconds)
    metrics.render()          # Prometheus text exposition, for GET /metrics
    gen = metrics.generate()  # the generate endpoint's metrics, in the same registry (one /metrics)

Metric (prefix ``layerzero_``)          type       labels     source
``requests_total``                      counter    segment    ``observe``: inference requests served (KServe v2)
``guard_runs_total``                    counter    segment    guard: its runs, inference requests and each step
                                                              of a generation alike
``fallbacks_total``                     counter    segment    guard (per run)
``reference_runs_total``                counter    reason     guard (sampled, kill_switch, max_tokens)
``threshold_backoffs_total``            counter    segment    guard
``kill_switch``                         gauge      –          guard (1 = every request to the reference)
``zeroing_threshold``                   gauge      segment    guard
``window_fallback_rate``                gauge      segment    guard (fallbacks / sampled in the window)
``zeroed_params_ratio``                 gauge      –          removed at compile time (static)
``request_zeroed_params_ratio``         histogram  –          ``observe``: compile time + skipped on the request
``skips_total``                         counter    path       ``observe``: each request's skipped paths
``request_latency_seconds``             histogram  route      ``observe``
``request_errors_total``                counter    –          ``observe_error``

The generate endpoint's (``GenerateMetrics``), each counted once per generation request, never per step:

``generate_requests_total``             counter    –          POST /v1/generate requests received
``generate_tokens_total``               counter    –          tokens generated (every prompt of a batch)
``generate_time_to_first_token_seconds`` histogram –          from the start of generation to its first token
``generate_inter_token_latency_seconds`` histogram –          between a generation's consecutive tokens (steps)
``generate_errors_total``               counter    code       requests refused (4xx) or failed (5xx), by status

Why ``requests_total`` is counted here and not read from the guard: every step of a generation runs through
the guard, so its count was decode steps (37 after 1 inference and 3 generations); the guard's count is
``guard_runs_total``. The guard's counters are read when Prometheus scrapes (a custom collector), so /metrics
and /status never disagree and the request path pays nothing for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from layerzero.runtime.engine import Result
    from layerzero.runtime.guard import GuardedEngine

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "RATIO_BUCKETS", "TOKEN_BUCKETS", "GenerateMetrics", "ServingMetrics"]

logger = logging.getLogger(__name__)

#: The Content-Type of ``ServingMetrics.render()``.
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Latency buckets in seconds: fine below 10 ms, where a small model's requests land.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: Zeroed-parameter-ratio buckets: tenths.
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: Time-to-first-token and inter-token buckets in seconds: a decode step of a small model to a long prefill.
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServingMetrics:
    """The metrics of one guarded engine (one server), in their own ``CollectorRegistry``."""

    def __init__(self, guard: GuardedEngine, *, namespace: str = "layerzero") -> None:
        self.guard = guard
        self.namespace = namespace
        self.registry = CollectorRegistry()
        self._latency = Histogram(
            f"{namespace}_request_latency_seconds",
            "Time to serve one inference request, by route (compiled, sampled, fallback, kill_switch, max_tokens)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._skips = Counter(
            f"{namespace}_skips", "Requests on which a dynamic path was skipped for every token", ["path"],
            registry=self.registry,
        )  # fmt: skip
        self._errors = Counter(f"{namespace}_request_errors", "Requests that failed", registry=self.registry)
        self._requests = Counter(
            f"{namespace}_requests", "Inference requests served (KServe v2, HTTP or gRPC), by segment", ["segment"],
            registry=self.registry,
        )  # fmt: skip
        for segment in guard.segments:
            self._requests.labels(segment)  # every segment shows, 0 until its first request
        self._ratio = Histogram(
            f"{namespace}_request_zeroed_params_ratio",
            "Fraction of the source model's parameters not computed on a request (removed + skipped)",
            buckets=RATIO_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_GuardCollector(guard, namespace))
        self._generate: GenerateMetrics | None = None

    def generate(self) -> GenerateMetrics:
        """The generate endpoint's metrics in this registry (made once: one /metrics for both endpoints)."""
        if self._generate is None:
            self._generate = GenerateMetrics(self.registry, namespace=self.namespace)
        return self._generate

    def observe(self, result: Result, seconds: float) -> None:
        """Record one served inference request: its count, latency and the paths it skipped."""
        self._requests.labels(getattr(result, "segment", "default")).inc()
        self._latency.labels(getattr(result, "route", "compiled")).observe(seconds)
        self._ratio.observe(result.report.zeroed_params_ratio)
        for path in result.report.skipped_paths:
            self._skips.labels(path).inc()

    def observe_error(self) -> None:
        self._errors.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class GenerateMetrics:
    """The generate endpoint's metrics (see the module doc), in ``registry`` (a new one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str = "layerzero") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        ns = f"{namespace}_generate"
        self._requests = Counter(f"{ns}_requests", "Generation requests received (POST /v1/generate)",
                                 registry=self.registry)  # fmt: skip
        self._tokens = Counter(f"{ns}_tokens", "Tokens generated, every prompt of a batch", registry=self.registry)
        self._first = Histogram(
            f"{ns}_time_to_first_token_seconds", "Time from the start of a generation to its first token",
            buckets=TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._between = Histogram(
            f"{ns}_inter_token_latency_seconds", "Time between consecutive tokens (steps) of a generation",
            buckets=TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._errors = Counter(f"{ns}_errors", "Generation requests refused (4xx) or failed (5xx), by HTTP status",
                               ["code"], registry=self.registry)  # fmt: skip

    def observe_request(self) -> None:
        self._requests.inc()

    def observe_generation(self, tokens: int, first_token_s: float | None, between_s: list[float]) -> None:
        """One generation that ended: its tokens, time to first token and the gaps between its steps."""
        self._tokens.inc(tokens)
        if first_token_s is not None:
            self._first.observe(first_token_s)
        for gap in between_s:
            self._between.observe(gap)

    def observe_error(self, status: int) -> None:
        self._errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GuardCollector(Collector):
    """The guard's counters and state, read at scrape time."""

    def __init__(self, guard: GuardedEngine, namespace: str) -> None:
        self._guard = guard
        self._ns = namespace
        self._zeroed_params_ratio = float(guard.engine.report_template().zeroed_params_ratio)

    def describe(self) -> list[Metric]:
        return []  # families are built from live state in collect(); nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        ns, stats = self._ns, self._guard.stats()
        segments = stats["segments"]

        def per_segment(family: CounterMetricFamily | GaugeMetricFamily, key: str) -> Metric:
            for name, seg in segments.items():
                family.add_metric([name], seg[key])
            return family

        yield per_segment(
            CounterMetricFamily(f"{ns}_guard_runs", "Runs through the guard (inference requests and each step of a "
                                "generation), by segment", labels=["segment"]),
            "requests",
        )  # fmt: skip
        yield per_segment(
            CounterMetricFamily(f"{ns}_fallbacks", "Sampled requests answered by the reference", labels=["segment"]),
            "fallbacks",
        )
        yield per_segment(
            CounterMetricFamily(f"{ns}_threshold_backoffs", "Automatic threshold back-offs", labels=["segment"]),
            "backoffs",
        )
        runs = CounterMetricFamily(f"{ns}_reference_runs", "Runs of the reference model, by reason", labels=["reason"])
        for reason, count in stats["reference_runs"].items():
            runs.add_metric([reason], count)
        yield runs
        yield GaugeMetricFamily(f"{ns}_kill_switch", "1 while every request goes to the reference",
                                value=float(stats["kill_switch"]))  # fmt: skip
        yield per_segment(
            GaugeMetricFamily(f"{ns}_zeroing_threshold", "Current zeroing threshold", labels=["segment"]), "threshold"
        )
        yield per_segment(
            GaugeMetricFamily(
                f"{ns}_window_fallback_rate", "Fallbacks / sampled requests in the guard's window", labels=["segment"]
            ),
            "window_fallback_rate",
        )
        yield GaugeMetricFamily(
            f"{ns}_zeroed_params_ratio", "Fraction of the source model's parameters removed at compile time",
            value=self._zeroed_params_ratio,
        )  # fmt: skip
