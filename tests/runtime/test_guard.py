"""GuardedEngine: sampled comparison and fallback, auto-raise on a fake clock, kill switch, segments, max_tokens."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import pytest

from layerzero.compile import compile_file
from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions
from layerzero.runtime import Engine
from layerzero.runtime.bundle import fingerprint_files
from layerzero.runtime.engine import THRESHOLD_INPUT
from layerzero.runtime.guard import GuardConfig, GuardedEngine, SegmentConfig, relative_l2

CONFIG = TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64, flag_form="consumed", zero_blocks=(1,))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _unary(tmp: Path, name: str, op: str) -> Path:
    """y = op(x), x: float[n]."""
    text = f'<ir_version: 8, opset_import: ["" : 17]> g (float[n] x) => (float[n] y) {{ y = {op}(x) }}'
    return _save(onnx.parser.parse_model(text), tmp / f"{name}.onnx")


def _with_threshold(tmp: Path) -> Path:
    """y = x + t, where t is the run-time threshold input (compiled default 0)."""
    text = f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[n] x, float "{THRESHOLD_INPUT}") => (float[n] y) {{ y = Add(x, "{THRESHOLD_INPUT}") }}"""
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.0, np.float32), THRESHOLD_INPUT))
    return _save(model, tmp / "threshold.onnx")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("guard")
    source = tmp / "source.onnx"
    onnx.save(build_transformer(CONFIG), str(source))
    bundle = tmp / "model.lz"
    compile_file(source, bundle, CompileOptions(dynamic=False))
    return {
        "source": source,
        "bundle": bundle,
        "relu": _unary(tmp, "relu", "Relu"),
        "identity": _unary(tmp, "identity", "Identity"),
        "threshold": _with_threshold(tmp),
    }


@pytest.fixture(scope="module")
def faulty_bundle(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled bundle with one weight corrupted after compilation (the fault the guard must catch)."""
    bundle = tmp_path_factory.mktemp("faulty") / "model.lz"
    compile_file(models["source"], bundle, CompileOptions(dynamic=False))
    model = onnx.load(str(bundle / "model.onnx"))
    weight = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    value = onnx.numpy_helper.to_array(weight)
    weight.CopyFrom(onnx.numpy_helper.from_array((value * -1.5).astype(value.dtype), weight.name))
    onnx.save(model, str(bundle / "model.onnx"))
    # A fault made before the bundle was fingerprinted (a miscompile), so Engine.load's integrity check passes it.
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["integrity"] = fingerprint_files(bundle, "model.onnx")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def _x(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array(values, dtype=np.float32)}


GOOD, BAD = _x(1.0, 2.0), _x(-1.0, 2.0)  # relu(BAD) != BAD: relative L2 error 0.447 > 0.05


def _relu_guard(models: dict[str, Path], clock: FakeClock | None = None, **config: object) -> GuardedEngine:
    return GuardedEngine(
        Engine.load(models["relu"]), Engine.load(models["identity"]), GuardConfig(**config), clock or FakeClock()
    )


# --------------------------------------------------------------------------------------- fault injection


def test_corrupted_weight_is_caught_by_sampling_and_falls_back(models: dict[str, Path], faulty_bundle: Path) -> None:
    feeds = example_feeds(CONFIG, seq=6)
    reference = Engine.load(models["source"]).run(feeds).outputs["logits"]
    faulty = Engine.load(faulty_bundle)
    assert relative_l2(faulty.run(feeds).outputs["logits"], reference) > 0.05  # the fault is real

    guard = GuardedEngine(faulty, models["source"], GuardConfig(sample_rate=1.0))
    result = guard.run(feeds)
    assert result.route == "fallback"
    assert result.report.fallback_triggered
    assert result.rel_l2 > 0.05
    np.testing.assert_array_equal(result.outputs["logits"], reference)
    stats = guard.stats()
    assert stats["fallbacks"] == 1 and stats["requests"] == 1 and stats["reference_runs"]["sampled"] == 1

    # Not sampled: the fault goes through, which is what sampling is for.
    unguarded = GuardedEngine(faulty, models["source"], GuardConfig(sample_rate=0.0)).run(feeds)
    assert unguarded.route == "compiled" and not unguarded.report.fallback_triggered
    assert relative_l2(unguarded.outputs["logits"], reference) > 0.05


def test_sampled_healthy_model_serves_compiled_outputs(models: dict[str, Path]) -> None:
    engine = Engine.load(models["bundle"])
    feeds = example_feeds(CONFIG, seq=5)
    result = GuardedEngine(engine, models["source"], GuardConfig(sample_rate=1.0)).run(feeds)
    assert result.route == "sampled" and not result.report.fallback_triggered
    assert result.rel_l2 < 1e-5
    np.testing.assert_array_equal(result.outputs["logits"], engine.run(feeds).outputs["logits"])


def test_sampling_is_seeded(models: dict[str, Path]) -> None:
    def routes(seed: int) -> list[str]:
        guard = _relu_guard(models, sample_rate=0.3, seed=seed)
        return [guard.run(GOOD).route for _ in range(40)]

    first = routes(7)
    assert first == routes(7)
    assert 0 < first.count("sampled") < 40


def test_guard_off_is_the_engine_and_loads_no_reference(models: dict[str, Path]) -> None:
    engine = Engine.load(models["bundle"])
    guard = GuardedEngine(engine, models["source"], GuardConfig(sample_rate=0.0))
    for seq in (3, 9):
        feeds = example_feeds(CONFIG, batch=2, seq=seq)
        result = guard.run(feeds)
        direct = engine.run(feeds)
        assert result.route == "compiled" and list(result.outputs) == list(direct.outputs)
        np.testing.assert_array_equal(result.outputs["logits"], direct.outputs["logits"])
        assert result.report == direct.report
    assert not guard.reference_loaded
    assert guard.stats()["requests"] == 2


# ------------------------------------------------------------------------------------------ auto back-off


def test_auto_backoff_fires_exactly_when_the_window_rate_passes_the_bound(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    guard = _relu_guard(models, clock, sample_rate=1.0, min_window_requests=20, window_seconds=100.0, threshold=0.06)
    assert guard.run(BAD).route == "fallback"  # 1/1 = 100 %, but too few requests
    for _ in range(18):
        guard.run(GOOD)
    assert guard.stats()["segments"]["default"]["window_fallback_rate"] == pytest.approx(1 / 19)
    assert guard.threshold() == 0.06  # 1/19 > 5 %, still too few requests
    guard.run(GOOD)
    assert guard.threshold() == 0.06  # 1/20 = 5 %: not above
    with caplog.at_level(logging.WARNING, logger="layerzero.runtime.guard"):
        guard.run(BAD)  # 2/21 > 5 % with 21 >= 20 requests
    assert guard.threshold() == pytest.approx(0.05)  # ÷ 1.2: skip less
    assert "zeroing threshold backed off 0.06 -> 0.05" in caplog.text
    seg = guard.stats()["segments"]["default"]
    assert seg["backoffs"] == 1 and seg["window_sampled"] == 0  # the window restarts at the new threshold
    assert seg["fallbacks"] == 2 and seg["sampled"] == 21

    for _ in range(19):
        guard.run(GOOD)
    guard.run(BAD)
    assert guard.threshold() == pytest.approx(0.05)  # 1/20
    guard.run(BAD)
    assert guard.threshold() == pytest.approx(0.05 / 1.2)
    assert guard.stats()["segments"]["default"]["backoffs"] == 2


def test_backoff_goes_to_zero_below_the_floor_and_stops_there(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    guard = _relu_guard(models, sample_rate=1.0, min_window_requests=1, threshold=0.011)
    guard.run(BAD)
    assert guard.threshold() == 0.0  # 0.011 / 1.2 < 0.01: exact skipping only
    with caplog.at_level(logging.WARNING, logger="layerzero.runtime.guard"):
        guard.run(BAD)
    assert guard.threshold() == 0.0
    assert guard.stats()["segments"]["default"]["backoffs"] == 1
    assert "at zeroing threshold 0: the compiled model itself deviates" in caplog.text


def test_old_fallbacks_age_out_of_the_window(models: dict[str, Path]) -> None:
    clock = FakeClock()
    guard = _relu_guard(models, clock, sample_rate=1.0, min_window_requests=20, window_seconds=100.0, threshold=0.06)
    guard.run(BAD)  # t = 0
    clock.now = 50.0
    for _ in range(19):
        guard.run(GOOD)  # 1/20 = 5 %: no back-off
    clock.now = 100.5
    guard.run(BAD)  # the t=0 fallback is gone: 1/20 again, where without aging it would be 2/21
    assert guard.threshold() == 0.06
    assert guard.stats()["segments"]["default"]["window_sampled"] == 20
    clock.now = 100.6
    guard.run(BAD)  # 2/21
    assert guard.threshold() == pytest.approx(0.05)
    clock.now = 1000.0
    assert guard.stats()["segments"]["default"]["window_sampled"] == 0


def test_auto_backoff_can_be_turned_off(models: dict[str, Path]) -> None:
    off = _relu_guard(models, sample_rate=1.0, min_window_requests=1, auto_backoff=False, threshold=0.5)
    for _ in range(5):
        off.run(BAD)
    assert off.threshold() == 0.5


# ------------------------------------------------------------------------------------------ kill switch


def test_kill_switch_takes_effect_on_the_next_request(models: dict[str, Path]) -> None:
    guard = _relu_guard(models, sample_rate=0.0)
    assert guard.run(BAD).route == "compiled"
    guard.set_kill_switch(True)
    result = guard.run(BAD)
    assert result.route == "kill_switch" and result.report.fallback_triggered
    np.testing.assert_array_equal(result.outputs["y"], BAD["x"])  # the reference (identity) answered
    guard.set_kill_switch(False)
    np.testing.assert_array_equal(guard.run(BAD).outputs["y"], [0.0, 2.0])
    assert guard.stats()["reference_runs"] == {"sampled": 0, "kill_switch": 1, "max_tokens": 0}


def test_kill_switch_flips_safely_under_concurrent_requests(models: dict[str, Path]) -> None:
    guard = _relu_guard(models, sample_rate=0.0)
    errors: list[BaseException] = []
    seen: list[str] = []
    stop = threading.Event()

    def client() -> None:
        try:
            for _ in range(300):
                if stop.is_set():
                    return
                result = guard.run(BAD)
                expected = BAD["x"] if result.route == "kill_switch" else np.maximum(BAD["x"], 0)
                np.testing.assert_array_equal(result.outputs["y"], expected)
                seen.append(result.route)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(20):
        guard.set_kill_switch(i % 2 == 0)
    guard.set_kill_switch(False)
    for t in threads:
        t.join(timeout=30)
    stop.set()
    assert not errors
    stats = guard.stats()
    assert stats["requests"] == len(seen) == 1200
    assert stats["reference_runs"]["kill_switch"] == seen.count("kill_switch")
    assert guard.run(BAD).route == "compiled"


def test_kill_switch_needs_a_reference(models: dict[str, Path]) -> None:
    guard = GuardedEngine(Engine.load(models["relu"]), None, GuardConfig(sample_rate=0.0))
    with pytest.raises(LayerZeroError, match="needs a reference"):
        guard.set_kill_switch(True)
    with pytest.raises(InvalidInputError, match="needs a reference"):
        GuardedEngine(Engine.load(models["relu"]), None, GuardConfig(sample_rate=0.5))


# ------------------------------------------------------------------------------- segments and thresholds


def test_segments_pick_their_settings(models: dict[str, Path]) -> None:
    guard = GuardedEngine(
        Engine.load(models["threshold"]),
        Engine.load(models["identity"]),
        GuardConfig(
            sample_rate=0.0,
            segments={"loose": SegmentConfig(threshold=0.5), "audit": SegmentConfig(sample_rate=1.0)},
        ),
    )
    assert guard.has_threshold_input
    x = GOOD["x"]
    plain = guard.run(GOOD)
    assert plain.route == "compiled" and plain.threshold == 0.0
    np.testing.assert_array_equal(plain.outputs["y"], x)
    loose = guard.run(GOOD, segment="loose")
    assert loose.route == "compiled" and loose.segment == "loose" and loose.threshold == 0.5
    np.testing.assert_array_equal(loose.outputs["y"], x + 0.5)  # the threshold reached the model
    audit = guard.run(GOOD, segment="audit")
    assert audit.route == "sampled" and audit.rel_l2 == 0.0
    stats = guard.stats()
    assert stats["reference_runs"]["sampled"] == 1
    assert {k: v["requests"] for k, v in stats["segments"].items()} == {"default": 1, "loose": 1, "audit": 1}
    assert stats["segments"]["loose"]["threshold"] == 0.5
    with pytest.raises(InvalidInputError, match="unknown segment 'nope'; known segments: default, loose, audit"):
        guard.run(GOOD, segment="nope")

    guard.set_threshold(0.25)
    np.testing.assert_array_equal(guard.run(GOOD).outputs["y"], x + 0.25)
    np.testing.assert_array_equal(guard.run(GOOD, segment="loose").outputs["y"], x + 0.5)
    with pytest.raises(InvalidInputError, match="zeroing threshold must be"):
        guard.set_threshold(-1.0)


def test_engine_threshold_needs_the_input(models: dict[str, Path]) -> None:
    engine = Engine.load(models["relu"])
    assert not engine.has_threshold_input
    with pytest.raises(InvalidInputError, match="has no 'layerzero::threshold' input"):
        engine.run(GOOD, threshold=0.1)
    np.testing.assert_array_equal(Engine.load(models["threshold"]).run(GOOD, threshold=1.0).outputs["y"], [2.0, 3.0])


def test_max_tokens_routes_long_requests_to_the_reference(models: dict[str, Path]) -> None:
    engine = Engine.load(models["bundle"])
    guard = GuardedEngine(engine, models["source"], GuardConfig(sample_rate=0.0, max_tokens=4))
    short, long = example_feeds(CONFIG, seq=4), example_feeds(CONFIG, seq=5)
    assert guard.run(short).route == "compiled"
    assert not guard.reference_loaded
    result = guard.run(long)
    assert result.route == "max_tokens" and result.report.fallback_triggered
    np.testing.assert_array_equal(result.outputs["logits"], Engine.load(models["source"]).run(long).outputs["logits"])
    assert guard.stats()["reference_runs"]["max_tokens"] == 1

    named = GuardedEngine(engine, models["source"], GuardConfig(sample_rate=0.0, max_tokens=4, token_input="input_ids"))
    assert named.run(long).route == "max_tokens"
    with pytest.raises(InvalidInputError, match="integer input"):
        _relu_guard(models, max_tokens=4)
    with pytest.raises(InvalidInputError, match="token_input 'ids' is not an input"):
        GuardedEngine(engine, models["source"], GuardConfig(max_tokens=4, token_input="ids"))


def test_reference_must_have_the_compiled_outputs(models: dict[str, Path]) -> None:
    with pytest.raises(LayerZeroError, match=r"lacks the compiled model's output\(s\) \['logits'\]"):
        GuardedEngine(Engine.load(models["bundle"]), Engine.load(models["identity"]), GuardConfig())
    guard = GuardedEngine(Engine.load(models["bundle"]), models["identity"], GuardConfig(sample_rate=1.0))
    # A path reference is checked when it loads. On a sampled request, a failing reference is logged and the
    # compiled result served: the safety net must not fail requests.
    assert guard.run(example_feeds(CONFIG)).route == "compiled"
    with pytest.raises(LayerZeroError, match="lacks"):
        guard.preload_reference()


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        ({"sample_rate": 1.5}, "sample_rate must be between 0 and 1"),
        ({"backoff_factor": 1.0}, "backoff_factor must be > 1"),
        ({"window_seconds": 0}, "window_seconds must be > 0"),
        ({"segments": {"a": SegmentConfig(threshold=float("nan"))}}, "zeroing threshold"),
    ],
)
def test_bad_config_is_an_invalid_input(config: dict, pattern: str) -> None:
    with pytest.raises(InvalidInputError, match=pattern):
        GuardConfig(**config)


def test_config_round_trips_through_json_dicts() -> None:
    config = GuardConfig(sample_rate=0.2, segments={"chat": SegmentConfig(threshold=0.1)}, max_tokens=64)
    assert GuardConfig.from_dict(config.to_dict()) == config
    with pytest.raises(InvalidInputError, match="unknown guard setting"):
        GuardConfig.from_dict({"sample_rat": 0.1})


def test_relative_l2() -> None:
    assert relative_l2([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert relative_l2([3.0, 4.0], [0.0, 0.0]) == float("inf")
    assert relative_l2([0.0, 0.0], [0.0, 0.0]) == 0.0
    assert relative_l2([np.nan, 1.0], [1.0, 1.0]) == float("inf")
    assert relative_l2([1.0], [1.0, 1.0]) == float("inf")
    assert relative_l2([3.0, 5.0], [3.0, 4.0]) == pytest.approx(0.2)
