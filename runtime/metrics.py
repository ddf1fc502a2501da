"""Prometheus metrics of a guarded engine, in a registry of their own (one per server).

    metrics = ServingMetrics(guard)
    result = guard.run(feeds); metrics.observe(result, seconds)
    metrics.render()          # Prometheus text exposition, for GET /metrics

Metric (prefix ``layerzero_``)          type       labels     source
``requests_total``                      counter    segment    guard counters, read at scrape time
``fallbacks_total``                     counter    segment    guard
``reference_runs_total``                counter    reason     guard (sampled, kill_switch, max_tokens)
``threshold_backoffs_total``              counter    segment    guard
``kill_switch``                         gauge      –          guard (1 = every request to the reference)
``zeroing_threshold``                   gauge      segment    guard
``window_fallback_rate``                gauge      segment    guard (fallbacks / sampled in the window)
``zeroed_params_ratio``                 gauge      –          removed at compile time (static)
``request_zeroed_params_ratio``         histogram  –          ``observe``: compile time + skipped on the request
``skips_total``                         counter    path       ``observe``: each request's skipped paths
``request_latency_seconds``             histogram  route      ``observe``
``request_errors_total``                counter    –          ``observe_error``

The guard's counters are read when Prometheus scrapes (a custom collector), so /metrics and /status never
disagree and the request path pays nothing for them.
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

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "RATIO_BUCKETS", "ServingMetrics"]

logger = logging.getLogger(__name__)

#: The Content-Type of ``ServingMetrics.render()``.
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Latency buckets in seconds: fine below 10 ms, where a small model's requests land.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: Zeroed-parameter-ratio buckets: tenths.
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


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
        self._ratio = Histogram(
            f"{namespace}_request_zeroed_params_ratio",
            "Fraction of the source model's parameters not computed on a request (removed + skipped)",
            buckets=RATIO_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_GuardCollector(guard, namespace))

    def observe(self, result: Result, seconds: float) -> None:
        """Record one served request: its latency and the paths it skipped."""
        self._latency.labels(getattr(result, "route", "compiled")).observe(seconds)
        self._ratio.observe(result.report.zeroed_params_ratio)
        for path in result.report.skipped_paths:
            self._skips.labels(path).inc()

    def observe_error(self) -> None:
        self._errors.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (``CONTENT_TYPE``)."""
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

        yield per_segment(CounterMetricFamily(f"{ns}_requests", "Requests served", labels=["segment"]), "requests")
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
