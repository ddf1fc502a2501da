"""``profile_bundle``: run calibration traffic through a bundle, count each path, measure its impact.

The counters are the runtime's (``layerzero.runtime.path_stats.Profiler``: it only needs the bundle's
``Engine``). The impact needs the force-off variant of the compiled model, built here in memory
(``layerzero.passes.force_off.ExposeForceOff``) and run as a second ``Engine`` on the first
``impact_samples`` requests: per request one run with nothing forced off, then one per subpath. A request
to a causal LM export may hold ``input_ids`` alone: the rest is filled as a generation's first step
(``Engine.first_step_feeds``).

With ``activations`` (``layerzero profile --activations``) the profile also records, per projection group of
``SparsifyActivations`` (q/k/v, o, gate/up, down of each layer), the distribution of its input's magnitudes
(``activation_calibration.activation_profile``: pooled quantile tables, per-channel quantiles, the error at each
level) under ``"activations"``; ``layerzero compile --profile P --activation-sparsity S`` calibrates from it. The
bundle must be dense there (compiled without ``--activation-sparsity``): calibration reads the dense activations.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.loader import load_model
from layerzero.passes.force_off import ExposeForceOff
from layerzero.runtime import Engine
from layerzero.runtime.path_stats import ImpactMeter, Profiler, iter_requests

__all__ = ["activation_record", "force_off_variant", "load_requests", "profile_bundle"]

logger = logging.getLogger(__name__)

#: ``(stage, done, total)``: stage "traffic" or "impact".
OnProgress = Callable[[str, int, int], None]


def load_requests(path: str | Path) -> list[dict[str, np.ndarray]]:
    """Requests from an ``.npz`` whose arrays have a leading request axis (one array per input name), or
    from a directory of ``.npz`` files, one request each (in file-name order)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InvalidInputError(f"{path}: no .npz files (one request per file expected)")
        return [_read_npz(f) for f in files]
    if not path.is_file():
        raise InvalidInputError(f"{path}: calibration data not found (an .npz file or a directory of them)")
    arrays = _read_npz(path)  # its errors name the file already
    try:
        requests = list(iter_requests(arrays))
    except InvalidInputError as exc:
        raise InvalidInputError(f"{path}: {exc}") from None
    if not requests:
        raise InvalidInputError(f"{path}: holds no requests (the leading request axis is empty)")
    return requests


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read requests (.npz expected): {exc}") from None
    if not arrays:
        raise InvalidInputError(f"{path}: the .npz holds no arrays")
    return arrays


def force_off_variant(engine: Engine, workdir: Path) -> tuple[Engine | None, str | None]:
    """The bundle's force-off variant as an ``Engine`` (its model written under ``workdir``); ``(None, why)``
    when it cannot be built."""
    # The variant runs on the bundle's own backend, which must be able to load an ONNX file (a TensorRT plan is
    # built at compile time; the profiler builds none).
    backend_cls = type(engine.backend)
    if not getattr(backend_cls, "loads_onnx", False):
        return None, f"the {engine.backend.name!r} backend cannot run the force-off variant (an ONNX model)"
    if not engine.manifest.get("dynamic"):
        return None, "the bundle has no dynamic path"
    model = load_model(engine.model_path)
    expose = ExposeForceOff()
    expose(model)
    for path, why in expose.missing.items():
        logger.warning("impact of %s is not measured: %s", path, why)
    if not expose.exposed:
        return None, "no dynamic path of the bundle could be forced off"
    target = workdir / "variant.onnx"
    ir.save(model, target, external_data=target.name + ".data", size_threshold_bytes=1 << 20)
    backend = backend_cls()
    backend.load(target)
    return Engine(backend, engine.manifest, path=engine.path, model_path=target), None


def profile_bundle(
    bundle: str | Path,
    requests: list[Mapping[str, Any]],
    *,
    impact_samples: int = 8,
    data: str | None = None,
    on_progress: OnProgress | None = None,
    activations: bool = False,
) -> dict[str, Any]:
    """Count every request on the bundle, measure impact on the first ``impact_samples``; the profile (with
    ``activations``: the projection inputs' magnitude distributions too, ``activation_record``)."""
    tick = on_progress or (lambda _stage, _done, _total: None)
    engine = Engine.load(bundle)
    if activations:
        _check_dense(engine)  # before the traffic: a wrong bundle is said at once
    # A causal LM export is profiled on text: a request of input_ids alone runs as the first step of a generation.
    requests = [engine.first_step_feeds(feeds) for feeds in requests]
    profiler = Profiler(engine)
    total = len(requests)
    for i, feeds in enumerate(requests):
        profiler.run(feeds)
        tick("traffic", i + 1, total)
    samples = min(max(impact_samples, 0), total)
    measured = 0
    if samples:
        with tempfile.TemporaryDirectory(prefix="layerzero-profile-") as tmp:
            variant, why = force_off_variant(engine, Path(tmp))
            if variant is None:
                logger.warning("zeroing impact not measured: %s", why)
            else:
                meter = ImpactMeter(variant)
                for i in range(samples):
                    profiler.add_impact(meter.measure(requests[i]))
                    tick("impact", i + 1, samples)
                measured = samples
    doc = profiler.to_dict(data=data, impact_samples=measured)
    if activations:
        doc["activations"] = activation_record(engine, requests)
    return doc


def _check_dense(engine: Engine) -> None:
    from layerzero.passes.sparsify_activations import KIND

    if any(isinstance(d, Mapping) and d.get("kind") == KIND for d in engine.manifest.get("dynamic") or []):
        raise InvalidInputError(
            f"--activations: {engine.path} is compiled with --activation-sparsity; profile a bundle of the model "
            "compiled without it (calibration needs the dense activations)"
        )


def activation_record(engine: Engine, requests: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The profile's ``"activations"``: each projection group's input distribution on ``requests`` (at most
    ``collect_activations``' token rows), run on the bundle's model as ONNX Runtime runs it."""
    from layerzero.activation_calibration import activation_profile, collect_activations
    from layerzero.passes.sparsify_activations import find_groups

    _check_dense(engine)
    model = load_model(engine.model_path)
    groups = find_groups(model)
    if not groups:
        raise InvalidInputError(
            f"--activations: {engine.path} has no projection group (no float MatMul with a constant 2-D weight "
            "inside a layer, model.layers.<i>...)"
        )
    got = collect_activations(model, groups, [dict(r) for r in requests])
    if not got:
        raise InvalidInputError("--activations: the requests gave no activations")
    return activation_profile(groups, got)
