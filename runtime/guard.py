"""The guard: serve a compiled engine with the original model as its safety net.

    guard = GuardedEngine(Engine.load("model.lz"), "model.onnx", GuardConfig(sample_rate=0.01))
    result = guard.run({"input_ids": ids}, segment="chat")
    result.outputs, result.route, result.report.fallback_triggered

Per request, in this order:

1. **Kill switch** on: the reference serves the request (route ``kill_switch``). A flip takes effect on the
   next request that starts after it.
2. **max_tokens**: a request with more tokens goes to the reference (route ``max_tokens``). Its token count is
   the size of the last axis of ``token_input`` (default: the first integer input).
3. The compiled engine runs, with the segment's zeroing threshold fed to ``layerzero::threshold`` when the
   model has that input and the threshold differs from the compiled default.
4. With probability ``sample_rate`` (a seeded RNG, so runs are reproducible) the reference runs too. If the
   relative L2 error ``‖compiled − reference‖₂ / ‖reference‖₂`` of any output exceeds ``fallback_bound``, the
   reference's outputs are returned, ``report.fallback_triggered`` is set and the fallback is counted (route
   ``fallback``); otherwise the compiled outputs are returned (route ``sampled``).
5. **Auto back-off**: over the sampled requests of the last ``window_seconds`` (per segment), once there are
   at least ``min_window_requests`` of them and the fallback rate (fallbacks / sampled) exceeds
   ``backoff_above`` (5 %), the segment's zeroing threshold is divided by ``backoff_factor`` (1.2), so the
   engine skips less; below ``backoff_floor`` it goes to 0 (exact skipping only). The change is logged as a
   warning and the window starts empty, so the next step is judged only on requests run at the new
   threshold. At threshold 0 there is nothing to back off: the fallbacks come from the compiled model itself
   (a fault, or a too-loose compile), which is logged once per window; the kill switch is the remedy.
   A model without the ``layerzero::threshold`` input records the change but cannot act on it (logged once).
   The threshold only ever goes down: under LayerZero's threshold (``CompileOptions.zeroing_threshold``: skip
   an expert or gated branch whose weight is below threshold × the token's largest weight) a higher threshold
   skips *more*, which would feed the deviation that caused the fallbacks (a runaway loop).
   A model compiled with activation sparsity (``layerzero::activation_scale``) backs off the same way at the same
   step: the segment's activation scale (from the engine's, 1 unless ``--no-activation-sparsity`` made it 0) is
   divided by ``backoff_factor``, and below ``backoff_floor`` it goes to 0 (the dense model exactly).

Whenever the returned outputs come from the reference, ``report.fallback_triggered`` is True and
``result.route`` says why. A reference-served request's report is the compiled model's static report (no
skipped paths); a ``fallback`` keeps the compiled run's report (what it skipped), flagged.

Off costs nothing: with sample rate 0, the kill switch off and no ``max_tokens``, ``run`` is the engine's
``run`` plus a few attribute reads and one uncontended lock for the counters (bench/serve_load.py measures
it), and the reference model is not loaded until a request needs it.

Thread-safe: counters, windows, thresholds and the RNG change under one lock; models run outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.contract import THRESHOLD_INPUT
from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.engine import Engine, Result

__all__ = [
    "DEFAULT_SEGMENT",
    "ROUTES",
    "GuardConfig",
    "GuardedEngine",
    "GuardedResult",
    "SegmentConfig",
    "relative_l2",
]

logger = logging.getLogger(__name__)

#: The segment of requests that name none.
DEFAULT_SEGMENT = "default"

#: ``GuardedResult.route`` values: who served the request and why.
ROUTES = ("compiled", "sampled", "fallback", "kill_switch", "max_tokens")
#: Routes whose outputs come from the reference model.
REFERENCE_ROUTES = ("fallback", "kill_switch", "max_tokens")


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """Settings of one traffic segment (``run(feeds, segment=name)``); None inherits the guard's."""

    threshold: float | None = None
    sample_rate: float | None = None


@dataclasses.dataclass
class GuardConfig:
    """Guard settings (see the module doc for what each does).

    Attributes:
        sample_rate: Fraction of requests also run on the reference and compared (0 = never, 1 = always).
        fallback_bound: Relative L2 error above which a sampled request falls back to the reference.
        window_seconds: Length of the sliding window the fallback rate is measured over.
        backoff_above: Fallback rate (fallbacks / sampled, in the window) above which the threshold backs off.
        backoff_factor: A back-off divides the zeroing threshold by this.
        backoff_floor: A backed-off threshold below this becomes 0 (exact).
        max_threshold: The largest threshold a segment may be set to.
        min_window_requests: Sampled requests the window must hold before a back-off.
        auto_backoff: Turn the auto back-off off.
        threshold: The default segment's starting zeroing threshold; None = the compiled one (the manifest's
            ``options.zeroing_threshold``, 0 when absent).
        max_tokens: Requests with more tokens go to the reference; None = no limit.
        token_input: The input whose last axis counts tokens; None = the first integer input.
        segments: Per-segment settings, chosen by ``run(..., segment=name)``; unknown names are an error.
        kill_switch: Start with the kill switch on.
        seed: Seed of the sampling RNG.
    """

    sample_rate: float = 0.01
    fallback_bound: float = 0.05
    window_seconds: float = 300.0
    backoff_above: float = 0.05
    backoff_factor: float = 1.2
    backoff_floor: float = 0.01
    max_threshold: float = 1.0
    min_window_requests: int = 100
    auto_backoff: bool = True
    threshold: float | None = None
    max_tokens: int | None = None
    token_input: str | None = None
    segments: dict[str, SegmentConfig] = dataclasses.field(default_factory=dict)
    kill_switch: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_rate("sample_rate", self.sample_rate)
        _check_rate("backoff_above", self.backoff_above)
        for name in ("fallback_bound", "window_seconds", "backoff_floor", "max_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidInputError(f"guard {name} must be a finite number >= 0, got {value!r}")
        if self.window_seconds <= 0:
            raise InvalidInputError(f"guard window_seconds must be > 0, got {self.window_seconds!r}")
        if not (math.isfinite(self.backoff_factor) and self.backoff_factor > 1):
            raise InvalidInputError(f"guard backoff_factor must be > 1, got {self.backoff_factor!r}")
        if self.min_window_requests < 1:
            raise InvalidInputError(f"guard min_window_requests must be >= 1, got {self.min_window_requests!r}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidInputError(f"guard max_tokens must be >= 0, got {self.max_tokens!r}")
        if self.threshold is not None:
            _check_threshold(self.threshold)
        for name, seg in self.segments.items():
            if seg.sample_rate is not None:
                _check_rate(f"segment {name!r} sample_rate", seg.sample_rate)
            if seg.threshold is not None:
                _check_threshold(seg.threshold)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["segments"] = {k: dataclasses.asdict(v) for k, v in self.segments.items()}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardConfig:
        """Inverse of ``to_dict`` (unknown keys are an error naming them)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise InvalidInputError(f"unknown guard setting(s) {unknown}; known: {sorted(fields)}")
        kwargs = dict(d)
        kwargs["segments"] = {k: SegmentConfig(**v) for k, v in (d.get("segments") or {}).items()}
        return cls(**kwargs)


@dataclasses.dataclass
class GuardedResult(Result):
    """``Result`` plus what the guard did: ``route`` (one of ``ROUTES``), the measured relative L2 error of a
    sampled request, the segment and the threshold the compiled model ran with."""

    route: str = "compiled"
    rel_l2: float | None = None
    segment: str = DEFAULT_SEGMENT
    threshold: float | None = None


@dataclasses.dataclass
class _Segment:
    name: str
    threshold: float
    sample_rate: float
    activation_scale: float = 1.0
    window: collections.deque = dataclasses.field(default_factory=collections.deque)  # (time, fell_back)
    window_fallbacks: int = 0
    requests: int = 0
    sampled: int = 0
    fallbacks: int = 0
    backoffs: int = 0


class GuardedEngine:
    """An ``Engine`` with sampled comparison against a reference, fallback, auto back-off and a kill switch.

    Args:
        engine: The compiled engine (anything with ``Engine``'s ``run``/``input_specs``/``output_names``).
        reference: The reference: an ``Engine``, or the path of the original model / bundle (loaded on first
            use), or None (no sampling, no kill switch, no max_tokens).
        config: ``GuardConfig``; the default samples 1 % of requests.
        clock: Seconds, monotonic; the fallback-rate window runs on it (tests pass a fake one).
        reference_options: Passed to ``Engine.load`` for a reference given as a path (e.g. ``device="cuda"``).
    """

    def __init__(
        self,
        engine: Engine,
        reference: Engine | str | os.PathLike[str] | None,
        config: GuardConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        reference_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._engine = engine
        self._config = config = config if config is not None else GuardConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._ref_lock = threading.Lock()
        self._reference: Engine | None = None
        self._reference_path: Path | None = None
        self._reference_options = dict(reference_options or {})
        if isinstance(reference, (str, os.PathLike)):
            self._reference_path = Path(reference)
            if not self._reference_path.exists():
                raise InvalidInputError(f"guard reference {self._reference_path} does not exist")
        elif reference is not None:
            self._reference = reference
            self._check_reference(reference)
        self._rng = random.Random(config.seed)
        self._kill = False
        self._reference_runs = {"sampled": 0, "kill_switch": 0, "max_tokens": 0}
        self._warned_no_threshold = False

        self._has_threshold = bool(getattr(engine, "has_threshold_input", False))
        self._has_scale = bool(getattr(engine, "has_activation_scale_input", False))
        self._engine_scale = 1.0 if (scale := getattr(engine, "activation_scale", None)) is None else float(scale)
        self.compiled_threshold = _compiled_threshold(getattr(engine, "manifest", {}) or {})
        default_threshold = config.threshold if config.threshold is not None else self.compiled_threshold
        settings = {DEFAULT_SEGMENT: SegmentConfig()} | dict(config.segments)
        default = settings[DEFAULT_SEGMENT]
        default_threshold = default.threshold if default.threshold is not None else default_threshold
        default_rate = default.sample_rate if default.sample_rate is not None else config.sample_rate
        self._segments: dict[str, _Segment] = {}
        for name, seg in settings.items():
            self._segments[name] = _Segment(
                name=name,
                threshold=float(seg.threshold if seg.threshold is not None else default_threshold),
                sample_rate=float(seg.sample_rate if seg.sample_rate is not None else default_rate),
                activation_scale=self._engine_scale,
            )

        self._token_input: str | None = None
        if config.max_tokens is not None:
            self._token_input = self._find_token_input(config.token_input)
        if reference is None and (config.kill_switch or config.max_tokens is not None):
            raise InvalidInputError("the guard's kill switch and max_tokens need a reference model")
        if reference is None and any(s.sample_rate > 0 for s in self._segments.values()):
            raise InvalidInputError(
                "guard sample_rate > 0 needs a reference model to compare against (pass one, or sample_rate=0)"
            )
        if config.kill_switch:
            self.set_kill_switch(True)

    # ------------------------------------------------------------------------------------------ properties

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def config(self) -> GuardConfig:
        return self._config

    @property
    def input_specs(self) -> list:
        return self._engine.input_specs

    @property
    def output_names(self) -> list[str]:
        return self._engine.output_names

    @property
    def has_reference(self) -> bool:
        return self._reference is not None or self._reference_path is not None

    @property
    def reference_loaded(self) -> bool:
        """Whether the reference model is loaded (it loads on the first request that needs it)."""
        return self._reference is not None

    @property
    def has_threshold_input(self) -> bool:
        """Whether the compiled model reads ``layerzero::threshold``, so threshold changes take effect."""
        return self._has_threshold

    @property
    def kill_switch(self) -> bool:
        return self._kill

    @property
    def segments(self) -> list[str]:
        return list(self._segments)

    # ------------------------------------------------------------------------------------------- control

    def set_kill_switch(self, on: bool) -> None:
        """Route every request (from the next one on) to the reference (on) or back to the compiled model."""
        on = bool(on)
        if on and not self.has_reference:
            raise LayerZeroError("the kill switch needs a reference model; none was given")
        with self._lock:
            changed, self._kill = self._kill != on, on
        if changed:
            logger.warning(
                "kill switch %s: %s", "ON" if on else "off", "serving the reference" if on else "serving compiled"
            )

    def threshold(self, segment: str | None = None) -> float:
        """The zeroing threshold the segment's requests run with."""
        return self._segment(segment).threshold

    def activation_scale(self, segment: str | None = None) -> float:
        """The activation-sparsity scale the segment's requests run with (1 as compiled, 0 dense)."""
        return self._segment(segment).activation_scale

    def set_threshold(self, value: float, segment: str | None = None) -> None:
        """Set a segment's zeroing threshold (from the next request on)."""
        _check_threshold(value)
        seg = self._segment(segment)
        with self._lock:
            old, seg.threshold = seg.threshold, float(value)
        logger.warning("segment %r zeroing threshold set %g -> %g", seg.name, old, value)
        self._warn_if_no_threshold_input()

    def preload_reference(self) -> None:
        """Load the reference now instead of on the first request that needs it."""
        if self.has_reference:
            self._ref()

    # ----------------------------------------------------------------------------------------------- run

    def run(self, feeds: Mapping[str, Any], *, segment: str | None = None, masks: bool = False) -> GuardedResult:
        """Run one request through the guard (see the module doc for the order of decisions).

        Raises:
            InvalidInputError: an unknown segment, or what ``Engine.run`` raises for bad feeds.
        """
        seg = self._segment(segment)
        if self._kill:
            return self._serve_reference(feeds, seg, "kill_switch")
        if self._token_input is not None and _tokens(feeds.get(self._token_input)) > self._config.max_tokens:
            return self._serve_reference(feeds, seg, "max_tokens")

        threshold = seg.threshold
        run_threshold = threshold if self._has_threshold and threshold != self.compiled_threshold else None
        rate = seg.sample_rate
        sample = False
        if rate > 0:
            if rate >= 1:
                sample = True
            else:
                with self._lock:
                    sample = self._rng.random() < rate
        extra: dict[str, float] = {} if run_threshold is None else {"threshold": run_threshold}
        if self._has_scale and seg.activation_scale != self._engine_scale:
            extra["activation_scale"] = seg.activation_scale
        result = self._engine.run(feeds, masks=masks, **extra)
        if not sample:
            with self._lock:
                seg.requests += 1
            return GuardedResult(result.outputs, result.report, "compiled", None, seg.name, threshold)

        try:
            reference = self._ref().run(self._reference_feeds(feeds))
        except Exception:
            # The safety net failing must not fail a request the compiled model served; count it as unsampled.
            logger.exception("segment %r: the reference failed on a sampled request; serving compiled", seg.name)
            with self._lock:
                seg.requests += 1
            return GuardedResult(result.outputs, result.report, "compiled", None, seg.name, threshold)
        error = max((relative_l2(result.outputs[n], reference.outputs[n]) for n in result.outputs), default=0.0)
        fell_back = error > self._config.fallback_bound
        self._record(seg, fell_back)
        if fell_back:
            logger.info("segment %r: relative L2 error %.4g > %g: serving the reference", seg.name, error,
                        self._config.fallback_bound)  # fmt: skip
            report = result.report
            report.fallback_triggered = True
            outputs = {n: reference.outputs[n] for n in result.outputs}
            return GuardedResult(outputs, report, "fallback", error, seg.name, threshold)
        return GuardedResult(result.outputs, result.report, "sampled", error, seg.name, threshold)

    # -------------------------------------------------------------------------------------------- status

    def stats(self) -> dict[str, Any]:
        """Counters and state, JSON-serialisable (the server's /status and the metrics read this)."""
        now = self._clock()
        with self._lock:
            segments = {}
            for seg in self._segments.values():
                self._prune(seg, now)
                n = len(seg.window)
                segments[seg.name] = {
                    "threshold": seg.threshold,
                    "sample_rate": seg.sample_rate,
                    "requests": seg.requests,
                    "sampled": seg.sampled,
                    "fallbacks": seg.fallbacks,
                    "backoffs": seg.backoffs,
                    "activation_scale": seg.activation_scale,
                    "window_sampled": n,
                    "window_fallbacks": seg.window_fallbacks,
                    "window_fallback_rate": seg.window_fallbacks / n if n else 0.0,
                }
            reference_runs = dict(self._reference_runs)
            kill = self._kill
        return {
            "kill_switch": kill,
            "requests": sum(s["requests"] for s in segments.values()),
            "fallbacks": sum(s["fallbacks"] for s in segments.values()),
            "reference_runs": reference_runs,
            "reference": None if not self.has_reference else str(self._reference_path or "<engine>"),
            "reference_loaded": self.reference_loaded,
            "has_threshold_input": self._has_threshold,
            "compiled_threshold": self.compiled_threshold,
            "segments": segments,
        }

    # ------------------------------------------------------------------------------------------ internals

    def _segment(self, name: str | None) -> _Segment:
        seg = self._segments.get(DEFAULT_SEGMENT if name is None or name == "" else name)
        if seg is None:
            raise InvalidInputError(f"unknown segment {name!r}; known segments: {', '.join(self._segments)}")
        return seg

    def _serve_reference(self, feeds: Mapping[str, Any], seg: _Segment, route: str) -> GuardedResult:
        reference = self._ref().run(self._reference_feeds(feeds))
        with self._lock:
            seg.requests += 1
            self._reference_runs[route] += 1
        report = self._engine.report_template()
        report.fallback_triggered = True
        outputs = {n: reference.outputs[n] for n in self._engine.output_names}
        return GuardedResult(outputs, report, route, None, seg.name, None)

    def _record(self, seg: _Segment, fell_back: bool) -> None:
        cfg = self._config
        now = self._clock()
        backed_off: tuple[float, float, float, int, str] | None = None
        with self._lock:
            seg.requests += 1
            seg.sampled += 1
            self._reference_runs["sampled"] += 1
            seg.window.append((now, fell_back))
            if fell_back:
                seg.fallbacks += 1
                seg.window_fallbacks += 1
            self._prune(seg, now)
            n = len(seg.window)
            rate = seg.window_fallbacks / n
            if cfg.auto_backoff and n >= cfg.min_window_requests and rate > cfg.backoff_above:
                old = seg.threshold
                new = old / cfg.backoff_factor
                if new < cfg.backoff_floor:
                    new = 0.0
                seg.threshold = new
                old_scale = seg.activation_scale
                if self._has_scale:
                    scale = old_scale / cfg.backoff_factor
                    seg.activation_scale = 0.0 if scale < cfg.backoff_floor else scale
                if new != old or seg.activation_scale != old_scale:
                    seg.backoffs += 1
                changed = seg.activation_scale != old_scale
                scale_note = f"; activation scale {old_scale:g} -> {seg.activation_scale:g}" if changed else ""
                seg.window.clear()
                seg.window_fallbacks = 0
                backed_off = (old, new, rate, n, scale_note)
        if backed_off is not None:
            old, new, rate, n, scale_note = backed_off
            if scale_note:
                logger.warning("segment %r: activation sparsity backed off%s", seg.name, scale_note)
                if old == new:
                    return
            if old == new:
                logger.warning(
                    "segment %r: fallback rate %.1f%% over the last %d sampled requests (%gs window) > %.1f%% "
                    "at zeroing threshold 0: the compiled model itself deviates; check it or turn the kill switch on",
                    seg.name, 100 * rate, n, cfg.window_seconds, 100 * cfg.backoff_above,
                )  # fmt: skip
                return
            logger.warning(
                "segment %r: fallback rate %.1f%% over the last %d sampled requests (%gs window) > %.1f%%: "
                "zeroing threshold backed off %g -> %g",
                seg.name, 100 * rate, n, cfg.window_seconds, 100 * cfg.backoff_above, old, new,
            )  # fmt: skip
            self._warn_if_no_threshold_input()

    def _prune(self, seg: _Segment, now: float) -> None:
        # Entries exactly window_seconds old are out: the window is (now - window_seconds, now].
        horizon = now - self._config.window_seconds
        window = seg.window
        while window and window[0][0] <= horizon:
            _, fell_back = window.popleft()
            seg.window_fallbacks -= fell_back

    def _warn_if_no_threshold_input(self) -> None:
        if not self._has_threshold and not self._warned_no_threshold:
            self._warned_no_threshold = True
            logger.warning(
                "the compiled model has no %r input: threshold changes are recorded "
                "(status, metrics) but do not change what it computes",
                THRESHOLD_INPUT,
            )

    def _ref(self) -> Engine:
        reference = self._reference
        if reference is not None:
            return reference
        with self._ref_lock:
            if self._reference is None:
                assert self._reference_path is not None
                started = time.perf_counter()
                loaded = Engine.load(self._reference_path, **self._reference_options)
                self._check_reference(loaded)
                self._reference = loaded
                logger.info("loaded the reference %s in %.2fs", self._reference_path, time.perf_counter() - started)
            return self._reference

    def _check_reference(self, reference: Engine) -> None:
        missing = [n for n in self._engine.output_names if n not in reference.output_names]
        if missing:
            raise LayerZeroError(
                f"the reference model lacks the compiled model's output(s) {missing} "
                f"(reference outputs: {reference.output_names}); is it the model this bundle was compiled from?"
            )

    def _reference_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        names = {s.name for s in self._ref().input_specs}
        return {k: v for k, v in feeds.items() if k in names}

    def _find_token_input(self, name: str | None) -> str:
        specs = self._engine.input_specs
        if name is not None:
            if name not in {s.name for s in specs}:
                raise InvalidInputError(
                    f"guard token_input {name!r} is not an input; inputs: {[s.name for s in specs]}"
                )
            return name
        for spec in specs:
            if np.dtype(spec.dtype).kind in "iu":
                return spec.name
        raise InvalidInputError(
            "guard max_tokens needs an integer input to count tokens in (or token_input=NAME); "
            f"inputs: {[s.describe() for s in specs]}"
        )


def relative_l2(got: Any, want: Any) -> float:
    """``‖got − want‖₂ / ‖want‖₂`` in float64; inf for a shape mismatch or a non-finite difference, and for any
    difference from an all-zero ``want``."""
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return math.inf
    g64, w64 = g.astype(np.float64, copy=False), w.astype(np.float64, copy=False)
    diff = float(np.linalg.norm((g64 - w64).ravel()))
    if not math.isfinite(diff):
        return math.inf
    norm = float(np.linalg.norm(w64.ravel()))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def _tokens(value: Any) -> int:
    if value is None:
        return 0
    shape = np.shape(value)
    return int(shape[-1]) if shape else 1


def _compiled_threshold(manifest: Mapping[str, Any]) -> float:
    options = manifest.get("options")
    value = options.get("zeroing_threshold") if isinstance(options, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _check_rate(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise InvalidInputError(f"guard {name} must be between 0 and 1, got {value!r}")


def _check_threshold(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidInputError(f"zeroing threshold must be a finite number >= 0, got {value!r}")
