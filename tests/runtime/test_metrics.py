"""ServingMetrics: the guard's counters and each request's latency and skips, in a registry per server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client (pip install 'layerzero[serve]')")

from prometheus_client.parser import text_string_to_metric_families

from layerzero.runtime import MASK_PREFIX, Engine, write_bundle
from layerzero.runtime.guard import GuardConfig, GuardedEngine, SegmentConfig
from layerzero.runtime.metrics import ServingMetrics

MANIFEST = {"target": "onnxruntime", "stats": {"params_before": 1000, "params_after": 750}}


def _model(tmp: Path, name: str, body: str, outputs: str) -> Path:
    model = onnx.parser.parse_model(
        f'<ir_version: 8, opset_import: ["" : 17]> g (float[n] x) => ({outputs}) {{ {body} }}'
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp / f"{name}.onnx"))
    return tmp / f"{name}.onnx"


@pytest.fixture
def guard(tmp_path: Path) -> GuardedEngine:
    """compiled: y = relu(x) with a mask output that is all false (path "experts.1" always skipped);
    reference: y = x. Negative inputs fall back when sampled."""
    mask = f"{MASK_PREFIX}experts.1"
    compiled = onnx.parser.parse_model(
        f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[n] x) => (float[n] y, bool[n] "{mask}") {{
            y = Relu(x)
            hi = Constant<value = float {{inf}}>()
            "{mask}" = Greater(x, hi)
        }}"""
    )
    bundle = write_bundle(tmp_path / "model.lz", compiled, MANIFEST)
    reference = _model(tmp_path, "reference", "y = Identity(x)", "float[n] y")
    config = GuardConfig(sample_rate=0.0, segments={"audit": SegmentConfig(sample_rate=1.0, threshold=0.2)})
    return GuardedEngine(Engine.load(bundle), reference, config)


def _samples(metrics: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_counters_gauges_and_latency(guard: GuardedEngine) -> None:
    metrics = ServingMetrics(guard)
    good, bad = {"x": np.array([1.0, 2.0], np.float32)}, {"x": np.array([-1.0, 2.0], np.float32)}
    for feeds, segment in ((good, None), (good, None), (bad, "audit"), (good, "audit")):
        metrics.observe(guard.run(feeds, segment=segment), 0.002)
    guard.set_kill_switch(True)
    metrics.observe(guard.run(good), 0.004)
    metrics.observe_error()

    s = _samples(metrics)
    assert s[("layerzero_requests_total", (("segment", "default"),))] == 3
    assert s[("layerzero_requests_total", (("segment", "audit"),))] == 2
    assert s[("layerzero_fallbacks_total", (("segment", "audit"),))] == 1
    assert s[("layerzero_fallbacks_total", (("segment", "default"),))] == 0
    assert s[("layerzero_reference_runs_total", (("reason", "sampled"),))] == 2
    assert s[("layerzero_reference_runs_total", (("reason", "kill_switch"),))] == 1
    assert s[("layerzero_kill_switch", ())] == 1
    assert s[("layerzero_zeroing_threshold", (("segment", "audit"),))] == pytest.approx(0.2)
    assert s[("layerzero_zeroing_threshold", (("segment", "default"),))] == 0
    assert s[("layerzero_window_fallback_rate", (("segment", "audit"),))] == 0.5
    assert s[("layerzero_zeroed_params_ratio", ())] == pytest.approx(0.25)
    # Compiled runs report the all-false mask as a skipped path; the kill-switch run did not run compiled.
    assert s[("layerzero_skips_total", (("path", "experts.1"),))] == 4
    assert s[("layerzero_request_latency_seconds_count", (("route", "compiled"),))] == 2
    assert s[("layerzero_request_latency_seconds_count", (("route", "fallback"),))] == 1
    assert s[("layerzero_request_latency_seconds_count", (("route", "kill_switch"),))] == 1
    assert s[("layerzero_request_latency_seconds_bucket", (("le", "0.003"), ("route", "compiled")))] == 2
    assert s[("layerzero_request_errors_total", ())] == 1
    assert s[("layerzero_request_zeroed_params_ratio_count", ())] == 5
    assert s[("layerzero_request_zeroed_params_ratio_bucket", (("le", "0.2"),))] == 0
    assert s[("layerzero_request_zeroed_params_ratio_bucket", (("le", "0.3"),))] == 5  # 0.25 removed at compile time


def test_each_server_has_its_own_registry(guard: GuardedEngine) -> None:
    first, second = ServingMetrics(guard), ServingMetrics(guard)  # no "duplicated timeseries" error
    assert first.registry is not second.registry
    first.observe_error()
    assert _samples(first)[("layerzero_request_errors_total", ())] == 1
    assert _samples(second)[("layerzero_request_errors_total", ())] == 0
