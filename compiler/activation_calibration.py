"""Calibrate ``SparsifyActivations``: per-channel thresholds for a model-wide activation sparsity (issue 23).

1. ``collect_activations``: run the model (ONNX Runtime) on calibration requests with each projection group's input
   as an extra output; keep up to ``max_tokens`` token rows of ``x`` per group (``[T, K]``).
2. ``GroupSamples``: a group's samples with its weights (the group's projections side by side, ``[K, N]``) and the
   row norms ``‖W_i,:‖`` of each input channel.
3. Thresholds of one group at sparsity ``s`` (``thresholds_at``): ``"magnitude"``, one threshold for every channel
   (the ``s``-quantile of ``|x|``); ``"wina"``, the ``s``-quantile ``t`` of ``|x_i|·‖W_i,:‖`` and ``t / ‖W_i,:‖``
   per channel (WINA's criterion, the same kernel test ``|x_i| <= threshold_i``). The quantiles come from a table
   of each criterion's pooled distribution at ``QUANTILE_STEPS + 1`` levels (``1 / QUANTILE_STEPS`` apart, linear
   between two): exact at every table level, and the same whether the samples are here or in a profile.
4. A group's error at ``s`` (``GroupSamples.error``): the relative squared error of its projections' outputs on
   the calibration tokens, ``‖(x − xm) W‖² / ‖x W‖²``, made monotone in ``s`` (a running maximum: a larger drop set
   can cancel by chance). With ``sensitivity`` (``probe_sensitivity``: the model-output deviation measured with
   that group alone at each of ``PROBE_LEVELS``, divided by its own error there; linear between two probes, flat
   outside) the error is brought to the model output, following the measured curve's shape in ``s``. The compile
   path measures the probes with ``output_deviation`` (one session, thresholds as inputs) on its calibration
   requests; bench/sparsity.py with the next-token KL on a calibration window.
5. Allocation for a model-wide target ``S`` (parameter-weighted: Σ params_g · s_g / Σ params_g), ``greedy``:
   TEAL's greedy, every group from 0, one step (``step``) at a time to the group whose next step costs the least
   error per parameter saved, until ``S`` (the last step stops between two levels, exactly at ``S``);
   ``uniform``: every group at ``S``; ``max_error``: the largest ``S`` (on the greedy path) whose measured
   deviation (``evaluate``) stays within a bound.

Each ``Allocation`` carries the thresholds (the pass's ``thresholds`` argument), each group's level and the curve
(model-wide sparsity → calibration error) for the report.

6. From a profile (``layerzero profile --activations``): ``activation_profile`` summarizes each group's samples
   (the quantile tables, the error at each level, per-channel quantiles of ``|x|`` at ``CHANNEL_LEVELS``) into the
   profile's ``"activations"``; ``profiled_groups`` reads them back as ``GroupProfile``, which the allocations take
   in place of ``GroupSamples``: the same tables and errors, so the same thresholds and levels as calibrating on
   the profiled requests directly. Only the realized sparsity differs: read off the table (within
   ``1 / QUANTILE_STEPS``) instead of counted on the samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerzero.contract import RUNTIME_PREFIX
from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.passes.sparsify_activations import ActivationGroup

__all__ = [
    "Allocation",
    "GroupProfile",
    "GroupSamples",
    "activation_profile",
    "collect_activations",
    "greedy",
    "group_samples",
    "max_error",
    "output_deviation",
    "probe_sensitivity",
    "profiled_activations",
    "profiled_groups",
    "uniform",
]

CRITERIA = ("magnitude", "wina")
#: Token rows a group's error is measured on (the quantiles use every sample).
ERROR_TOKENS = 256
#: The pooled quantile tables hold the levels 0, 1/QUANTILE_STEPS, ..., 1 (thresholds between two: linear).
QUANTILE_STEPS = 1000
#: The levels of the per-channel |x| quantiles a profile records.
CHANNEL_LEVELS = np.round(np.linspace(0.0, 1.0, 21), 4)
#: The levels each group is probed at alone (``probe_sensitivity``) by the compile path and bench/sparsity.py.
PROBE_LEVELS = (0.3, 0.5, 0.7)
#: The version of a profile's "activations" record.
ACTIVATION_PROFILE_VERSION = 1
Evaluate = Callable[[Mapping[str, np.ndarray]], float]


def collect_activations(
    model: ir.Model, groups: Sequence[ActivationGroup], requests: Iterable[Mapping[str, np.ndarray]],
    max_tokens: int = 2048,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Every group's input ``x`` on ``requests`` (``[T, K]`` float32, at most ``max_tokens`` rows each).

    The model (with the groups' inputs as extra outputs, removed again before returning) is saved to a temporary
    folder with its weights in external data and the session is made from that file: a model loaded from a file
    with external data (every export over 2 GB) has initializers that name their data relative to the source's
    folder, which a session made from serialised bytes cannot resolve, and a model over 2 GB cannot be one
    protobuf anyway."""
    import tempfile
    from pathlib import Path

    from layerzero.ort_runner import create_session

    graph = model.graph
    added = []
    for g in groups:
        if g.x not in graph.outputs:
            graph.outputs.append(g.x)
            added.append(g.x)
    # ir.save loads the source's external tensors at or under its threshold into memory and releases their memory
    # map, which a live view of one (an array of the pass's) refuses (BufferError): those few small ones are lent
    # as in-memory copies instead, and every one is put back afterwards.
    inline = 1 << 10  # shape constants ONNX Runtime's shape inference reads stay in the file
    swapped = []
    for g in model.graphs():
        for value in g.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= inline:
                swapped.append((value, tensor))
                value.const_value = ir.Tensor(np.array(tensor.numpy()), name=tensor.name)
    try:
        with tempfile.TemporaryDirectory(prefix="layerzero-calibration-") as tmp:
            path = Path(tmp) / "calibration.onnx"
            ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=inline)
            session = create_session(path, label="the calibration model")
            try:
                return _run_requests(session, groups, requests, max_tokens)
            finally:
                del session
    finally:
        for value in added:
            graph.outputs.remove(value)
        for value, tensor in swapped:
            value.const_value = tensor


def _run_requests(
    session, groups: Sequence[ActivationGroup], requests: Iterable[Mapping[str, np.ndarray]], max_tokens: int
) -> dict[str, np.ndarray]:
    names = [g.x.name for g in groups]
    got: dict[str, list[np.ndarray]] = {g.name: [] for g in groups}
    rows = 0
    for feeds in requests:
        values = session.run(names, dict(feeds))
        for g, v in zip(groups, values, strict=True):
            got[g.name].append(np.asarray(v, np.float32).reshape(-1, g.channels))
        rows += got[groups[0].name][-1].shape[0] if groups else 0
        if rows >= max_tokens:
            break
    return {n: np.concatenate(v)[:max_tokens] for n, v in got.items() if v}


@dataclasses.dataclass
class GroupSamples:
    """One group's calibration samples ``x`` ``[T, K]`` and its weights ``[K, N]`` (projections side by side)."""

    name: str
    samples: np.ndarray
    weight: np.ndarray
    levels: np.ndarray = dataclasses.field(default_factory=lambda: np.round(np.arange(0.0, 0.951, 0.05), 4))

    def __post_init__(self) -> None:
        self.samples = np.asarray(self.samples, np.float32)
        self.magnitudes = np.abs(self.samples)
        self.weight = np.asarray(self.weight, np.float32)
        self.row_norms = np.linalg.norm(self.weight, axis=1).astype(np.float32)
        self._errors: dict[str, np.ndarray] = {}
        self._tables: dict[str, np.ndarray] = {}

    @property
    def params(self) -> int:
        return int(self.weight.size)

    @property
    def channels(self) -> int:
        return int(self.weight.shape[0])

    def table(self, criterion: str) -> np.ndarray:
        """The pooled quantiles of the criterion's values (``|x|``, or ``|x_i|·‖W_i,:‖``) at the table levels."""
        _check_criterion(criterion)
        if criterion not in self._tables:
            values = self.magnitudes if criterion == "magnitude" else self.magnitudes * _norms(self.row_norms)
            self._tables[criterion] = np.quantile(values, _GRID)
        return self._tables[criterion]

    def thresholds_at(self, s: float, criterion: str = "wina") -> np.ndarray:
        """Per-channel thresholds that drop a fraction ``s`` of the calibration entries (0 at ``s`` = 0)."""
        return _thresholds(self, s, criterion)

    def error(self, criterion: str = "wina") -> np.ndarray:
        """The relative output error at each of ``levels`` (monotone)."""
        if criterion not in self._errors:
            x = self.samples[:ERROR_TOKENS]
            dense = float(np.square(x @ self.weight).sum()) or 1.0
            errs = []
            for s in self.levels:
                t = self.thresholds_at(float(s), criterion)
                dropped = np.where(np.abs(x) <= t, x, 0.0).astype(np.float32)
                errs.append(float(np.square(dropped @ self.weight).sum()) / dense)
            self._errors[criterion] = np.maximum.accumulate(np.array(errs))
        return self._errors[criterion]

    def realized(self, thresholds: np.ndarray, criterion: str | None = None) -> float:
        """The fraction of calibration entries ``thresholds`` drop (counted on the samples)."""
        return float(np.mean(self.magnitudes <= thresholds))

    def summary(self) -> dict[str, object]:
        """What a profile records of this group (``activation_profile``; ``GroupProfile`` reads it back)."""
        # Per-channel quantiles to 6 significant digits (informational, not read by the allocation; a 135M model
        # has ~2M of them).
        per_channel = np.quantile(self.magnitudes, CHANNEL_LEVELS, axis=0).tolist()
        return {
            "channels": self.channels,
            "params": self.params,
            "rows": int(self.samples.shape[0]),
            "levels": [float(v) for v in self.levels],
            "error": {c: [float(v) for v in self.error(c)] for c in CRITERIA},
            "quantiles": {c: [float(v) for v in self.table(c)] for c in CRITERIA},
            "channel_quantiles": {
                "levels": [float(v) for v in CHANNEL_LEVELS],
                "values": [[float(f"{v:.6g}") for v in row] for row in per_channel],
            },
        }


_GRID = np.linspace(0.0, 1.0, QUANTILE_STEPS + 1)


def _check_criterion(criterion: str) -> None:
    if criterion not in CRITERIA:
        raise InvalidInputError(f"activation criterion {criterion!r}: expected one of {', '.join(CRITERIA)}")


def _norms(row_norms: np.ndarray) -> np.ndarray:
    return np.maximum(row_norms, np.float32(1e-30))


def _thresholds(group: GroupSamples | GroupProfile, s: float, criterion: str) -> np.ndarray:
    """Thresholds at level ``s`` from the group's quantile table (module docstring, 3)."""
    _check_criterion(criterion)
    if s <= 0:
        return np.zeros(group.channels, np.float32)
    t = float(np.interp(s, _GRID, group.table(criterion)))
    if criterion == "magnitude":
        return np.full(group.channels, t, np.float32)
    return (t / _norms(group.row_norms)).astype(np.float32)


@dataclasses.dataclass
class GroupProfile:
    """A group calibrated from a profile's summary (``GroupSamples.summary``) and the compiled model's weights:
    the same tables and errors as the ``GroupSamples`` it was written from, no samples."""

    name: str
    record: Mapping[str, object]
    weight_norms: np.ndarray
    params: int

    def __post_init__(self) -> None:
        r = self.record
        self.row_norms = np.asarray(self.weight_norms, np.float32)
        self.levels = np.asarray(r["levels"], float)
        self._errors = {c: np.asarray(r["error"][c], float) for c in CRITERIA}
        self._tables = {c: np.asarray(r["quantiles"][c], float) for c in CRITERIA}
        self.rows = int(r["rows"])

    @property
    def channels(self) -> int:
        return int(self.row_norms.shape[0])

    def table(self, criterion: str) -> np.ndarray:
        _check_criterion(criterion)
        return self._tables[criterion]

    def thresholds_at(self, s: float, criterion: str = "wina") -> np.ndarray:
        return _thresholds(self, s, criterion)

    def error(self, criterion: str = "wina") -> np.ndarray:
        _check_criterion(criterion)
        return self._errors[criterion]

    def realized(self, thresholds: np.ndarray, criterion: str | None = None) -> float:
        """The fraction of the profiled entries ``thresholds`` drop, read off the table (within a table step)."""
        crit = criterion or "wina"
        t = thresholds if crit == "magnitude" else thresholds * _norms(self.row_norms)
        return _cdf(self.table(crit), float(np.max(t)) if t.size else 0.0)


def _cdf(table: np.ndarray, t: float) -> float:
    """The fraction of values <= ``t`` of the distribution whose quantiles at the table levels are ``table``."""
    i = int(np.searchsorted(table, t, side="right"))  # table[i - 1] <= t < table[i]
    if i == 0:
        return 0.0
    if i >= len(table):
        return 1.0
    lo, hi = float(table[i - 1]), float(table[i])
    part = (t - lo) / (hi - lo) if hi > lo else 0.0
    return ((i - 1) + part) / QUANTILE_STEPS


def activation_profile(groups: Sequence[ActivationGroup], activations: Mapping[str, np.ndarray]) -> dict[str, object]:
    """A profile's ``"activations"`` record: each group's ``GroupSamples.summary``."""
    samples = group_samples(groups, activations)
    return {
        "version": ACTIVATION_PROFILE_VERSION,
        "quantile_steps": QUANTILE_STEPS,
        "error_tokens": ERROR_TOKENS,
        "groups": {g.name: g.summary() for g in samples},
    }


def profiled_activations(path: str | Path) -> dict[str, object] | None:
    """The ``"activations"`` record of the profile at ``path`` (``layerzero profile --activations``), else None."""
    from layerzero.runtime.path_stats import load_profile

    record = load_profile(path).get("activations")
    return record if isinstance(record, dict) else None


def profiled_groups(groups: Sequence[ActivationGroup], record: object, where: str) -> list[GroupProfile]:
    """The model's ``groups`` calibrated from a profile's ``"activations"`` record (``where`` names it in errors):
    every group must be in it with the same channels and parameters (a profile of a bundle of this model)."""
    ok = isinstance(record, Mapping) and isinstance(record.get("groups"), Mapping)
    if not ok or record.get("version") != ACTIVATION_PROFILE_VERSION or record.get("quantile_steps") != QUANTILE_STEPS:
        raise InvalidInputError(
            f"{where}: its activations record is not version {ACTIVATION_PROFILE_VERSION} with "
            f"{QUANTILE_STEPS} quantile steps (profile the bundle again with --activations)"
        )
    profiled = record["groups"]
    out = []
    for g in groups:
        r = profiled.get(g.name)
        if not isinstance(r, Mapping):
            raise InvalidInputError(
                f"{where}: no activations of group {g.name!r} (profile a bundle of this model, compiled without "
                "--activation-sparsity, with --activations)"
            )
        if r.get("channels") != g.channels or r.get("params") != g.params:
            raise InvalidInputError(
                f"{where}: group {g.name!r} has {r.get('channels')} channels and {r.get('params')} parameters "
                f"in the profile, {g.channels} and {g.params} in this model (a profile of another model?)"
            )
        weight = np.concatenate([np.asarray(w, np.float32) for w in g.weights], axis=1)
        try:
            out.append(GroupProfile(g.name, r, np.linalg.norm(weight, axis=1).astype(np.float32), g.params))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"{where}: the activations of group {g.name!r} are malformed ({exc})") from None
        if any(len(v) != QUANTILE_STEPS + 1 for v in out[-1]._tables.values()) or any(
            len(v) != len(out[-1].levels) for v in out[-1]._errors.values()
        ):
            raise InvalidInputError(f"{where}: the activations of group {g.name!r} have tables of the wrong length")
    return out


def group_samples(
    groups: Sequence[ActivationGroup], activations: Mapping[str, np.ndarray], levels: np.ndarray | None = None
) -> list[GroupSamples]:
    """``GroupSamples`` of each group that has samples."""
    out = []
    for g in groups:
        if g.name in activations:
            weight = np.concatenate([np.asarray(w, np.float32) for w in g.weights], axis=1)
            kw = {} if levels is None else {"levels": np.asarray(levels, float)}
            out.append(GroupSamples(g.name, activations[g.name], weight, **kw))
    return out


@dataclasses.dataclass
class Allocation:
    """Thresholds per group (the pass's argument), the level of each, the model-wide sparsity they reach on the
    calibration samples (parameter-weighted) and the curve (sparsity, calibration error) that led there."""

    method: str
    target: float
    thresholds: dict[str, np.ndarray]
    levels: dict[str, float]
    sparsity: float
    curve: list[tuple[float, float]]
    #: ``max_error``: the greedy target chosen and the deviation measured there.
    chosen: float | None = None
    deviation: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "method": self.method,
            "target": self.target,
            "sparsity": self.sparsity,
            "levels": dict(self.levels),
            "curve": [[float(s), float(e)] for s, e in self.curve],
            "chosen": self.chosen,
            "deviation": self.deviation,
        }


def _check_target(target: float) -> None:
    if not (0 <= target < 1):
        raise InvalidInputError(f"activation sparsity must be in [0, 1), got {target!r}")


def _weighted(groups: Sequence[GroupSamples], levels: Mapping[str, float]) -> float:
    total = sum(g.params for g in groups) or 1
    return sum(g.params * levels[g.name] for g in groups) / total


def _finish(method: str, target: float, groups: Sequence[GroupSamples], index: Mapping[str, int], criterion: str,
            curve: list[tuple[float, float]], partial: tuple[str, float] | None = None) -> Allocation:  # fmt: skip
    levels = {g.name: float(g.levels[index[g.name]]) for g in groups}
    if partial is not None:
        levels[partial[0]] = partial[1]
    thresholds = {g.name: g.thresholds_at(levels[g.name], criterion) for g in groups}
    total = sum(g.params for g in groups) or 1
    realized = sum(g.params * g.realized(thresholds[g.name], criterion) for g in groups) / total
    return Allocation(method, target, thresholds, levels, float(realized), curve)


def uniform(groups: Sequence[GroupSamples], target: float, criterion: str = "magnitude",
            sensitivity: Mapping[str, float | np.ndarray] | None = None) -> Allocation:  # fmt: skip
    """Every group at level ``target`` exactly (its error interpolated between the two levels around it)."""
    _check_target(target)
    levels = {g.name: float(target) for g in groups}
    thresholds = {g.name: g.thresholds_at(float(target), criterion) for g in groups}
    err = sum(float(np.interp(target, g.levels, _model_errors(g, criterion, (sensitivity or {}).get(g.name, 1.0))))
              for g in groups)  # fmt: skip
    total = sum(g.params for g in groups) or 1
    realized = sum(g.params * g.realized(thresholds[g.name], criterion) for g in groups) / total
    return Allocation("uniform", target, thresholds, levels, float(realized), [(float(target), float(err))])


def greedy(groups: Sequence[GroupSamples], target: float, criterion: str = "wina",
           sensitivity: Mapping[str, float | np.ndarray] | None = None) -> Allocation:  # fmt: skip
    """TEAL's greedy: the step of least error per parameter saved, until the model-wide sparsity reaches ``target``."""
    _check_target(target)
    errors = {g.name: _model_errors(g, criterion, (sensitivity or {}).get(g.name, 1.0)) for g in groups}
    index = {g.name: 0 for g in groups}
    total = sum(g.params for g in groups) or 1
    reached = 0.0
    err = sum(errors[g.name][0] for g in groups)
    curve = [(0.0, float(err))]
    while reached < target - 1e-9:
        best, best_cost = None, np.inf
        for g in groups:
            i = index[g.name]
            if i + 1 >= len(g.levels):
                continue
            e = errors[g.name]
            saved = g.params * (g.levels[i + 1] - g.levels[i])
            cost = (e[i + 1] - e[i]) / max(saved, 1e-12)
            if cost < best_cost:
                best, best_cost = g, cost
        if best is None:
            break
        i = index[best.name]
        e = errors[best.name]
        gain = best.params * (best.levels[i + 1] - best.levels[i]) / total
        if reached + gain > target + 1e-9:  # the last step goes only as far as the target (a level between two)
            part = (target - reached) / gain
            level = float(best.levels[i] + part * (best.levels[i + 1] - best.levels[i]))
            curve.append((float(target), float(err + part * (e[i + 1] - e[i]))))
            return _finish("greedy", target, groups, index, criterion, curve, (best.name, level))
        err += e[i + 1] - e[i]
        reached += gain
        index[best.name] = i + 1
        curve.append((float(reached), float(err)))
    return _finish("greedy", target, groups, index, criterion, curve)


def probe_sensitivity(groups: Sequence[GroupSamples], evaluate: Evaluate, probe: float | Sequence[float] = 0.5,
                      criterion: str = "wina") -> dict[str, float | np.ndarray]:  # fmt: skip
    """Per group: the model-output deviation ``evaluate`` measures with that group alone at level ``probe``,
    divided by the group's own error there (so the greedy's errors are in the model output's unit).

    ``probe`` a sequence of levels: each group is measured alone at each of them and its sensitivity is an array
    over its ``levels`` (the ratio at each probe, linear between two, held flat outside them), so the greedy
    follows the measured model-output error's own shape in ``s``, not one ratio taken at one level."""
    probes = [float(probe)] if np.isscalar(probe) else sorted({float(p) for p in probe})
    if not probes or any(not (0 < p < 1) for p in probes):
        raise InvalidInputError(f"probe levels must be in (0, 1), got {probe!r}")
    out: dict[str, float | np.ndarray] = {}
    for g in groups:
        at, ratios = [], []
        for p in probes:
            i = int(np.argmin(np.abs(g.levels - p)))
            if at and g.levels[i] == at[-1]:
                continue
            deviation = float(evaluate({g.name: g.thresholds_at(float(g.levels[i]), criterion)}))
            own = float(g.error(criterion)[i])
            at.append(float(g.levels[i]))
            ratios.append(deviation / own if own > 0 else 0.0)
        out[g.name] = ratios[0] if np.isscalar(probe) else np.interp(g.levels, at, ratios)
    return out


def _model_errors(g: GroupSamples | GroupProfile, criterion: str, sensitivity: float | np.ndarray) -> np.ndarray:
    """The group's error at each of its levels in the model output's unit (monotone: a running maximum)."""
    return np.maximum.accumulate(np.asarray(sensitivity, float) * g.error(criterion))


def max_error(groups: Sequence[GroupSamples], bound: float, evaluate: Evaluate, criterion: str = "wina",
              sensitivity: Mapping[str, float | np.ndarray] | None = None, step: float = 0.05,
              cap: float = 0.95) -> Allocation:  # fmt: skip
    """The largest model-wide sparsity on the greedy path (``step`` apart, up to ``cap`` and ``cap`` itself) whose
    measured deviation is <= ``bound``; its curve is (greedy target, measured deviation) at each level tried, its
    ``deviation`` the one measured at the level chosen (0 at sparsity 0: the dense model)."""
    if not (np.isfinite(bound) and bound >= 0):
        raise InvalidInputError(f"activation impact bound must be finite and >= 0, got {bound!r}")
    _check_target(cap)
    best = greedy(groups, 0.0, criterion, sensitivity)
    chosen = (0.0, 0.0)
    curve: list[tuple[float, float]] = [(0.0, 0.0)]
    targets = [round(float(t), 6) for t in np.arange(step, cap + 1e-9, step)]
    if cap > 0 and (not targets or abs(targets[-1] - cap) > 1e-9):
        targets.append(float(cap))
    for target in targets:
        alloc = greedy(groups, target, criterion, sensitivity)
        deviation = float(evaluate(alloc.thresholds))
        curve.append((target, deviation))
        if not deviation <= bound:  # NaN stops too
            break
        best, chosen = alloc, (target, deviation)
    return dataclasses.replace(best, method="max_error", target=float(bound), curve=curve, chosen=chosen[0],
                               deviation=chosen[1])  # fmt: skip


def output_deviation(model: ir.Model, requests: Sequence[Mapping[str, np.ndarray]]) -> Evaluate:
    """The probes' and ``max_error``'s measure on ``model`` (reference form, plain ONNX Runtime): for thresholds,
    the largest relative L2 change of a user output (``layerzero::`` outputs left out) from the dense model over
    ``requests``, the unit of the profile's zeroing impact.

    One session serves every evaluation: a copy of the model with every group in ``SparsifyActivations``' reference
    form and its thresholds made graph inputs (zeros: the dense model, which is the reference), so a probe costs
    one run of the requests, not a session."""
    from layerzero.ort_runner import create_session
    from layerzero.passes.shape_inference import InferShapes
    from layerzero.passes.sparsify_activations import SparsifyActivations, find_groups
    from layerzero.runtime.guard import relative_l2

    if not requests:
        raise InvalidInputError("activation impact tolerance: no calibration request to measure the deviation on")
    proto = ir.to_proto(model)
    names = [o.name for o in proto.graph.output if not o.name.startswith(RUNTIME_PREFIX)]
    # A model loaded from a file with external data (every export over 2 GB) names its data relative to that file's
    # folder: the session made from bytes resolves them there (no copy of the weights is written).
    folders = {t.const_value.base_dir for g in model.graphs() for t in g.initializers.values()
               if isinstance(t.const_value, ir.ExternalTensor)}  # fmt: skip
    if len(folders) > 1:
        raise UnsupportedModelError(f"activation impact tolerance: external data in {len(folders)} folders")
    data_dir = next(iter(folders), None) or None
    variant = ir.from_proto(proto)
    if data_dir:  # the copy's external tensors read from where the model's do
        for g in variant.graphs():
            for v in g.initializers.values():
                if isinstance(v.const_value, ir.ExternalTensor):
                    v.const_value.base_dir = data_dir
    InferShapes()(variant)
    groups = find_groups(variant)
    SparsifyActivations({g.name: np.ones(g.channels, np.float32) for g in groups}, native=False)(variant)
    inputs: dict[str, tuple[str, np.dtype]] = {}
    graph_inputs = {v.name for v in variant.graph.inputs}
    for g in groups:
        init = variant.graph.initializers.get(f"{g.name}.activation_thresholds")
        if init is None:  # refused by the pass (its rank unknown): never sparsified
            continue
        if init.name not in graph_inputs:
            variant.graph.inputs.append(init)
        inputs[g.name] = (init.name, init.const_value.numpy().dtype)
    session = create_session(ir.to_proto(variant).SerializeToString(), external_data_dir=data_dir,
                             label="the activation-sparse calibration model")  # fmt: skip
    channels = {g.name: g.channels for g in groups}

    def run(thresholds: Mapping[str, np.ndarray]) -> list[list[np.ndarray]]:
        unknown = sorted(set(thresholds) - set(inputs))
        if unknown:
            raise InvalidInputError(f"activation thresholds name {unknown[0]!r}, which is no sparsified group")
        feeds = {name: np.asarray(thresholds[g], dtype) if g in thresholds else np.zeros(channels[g], dtype)
                 for g, (name, dtype) in inputs.items()}  # fmt: skip
        return [session.run(names, {**dict(r), **feeds}) for r in requests]

    dense = run({})

    def evaluate(thresholds: Mapping[str, np.ndarray]) -> float:
        worst = 0.0
        for got_all, want in zip(run(thresholds), dense, strict=True):
            for got, base in zip(got_all, want, strict=True):
                if np.issubdtype(np.asarray(base).dtype, np.floating):
                    worst = max(worst, float(relative_l2(np.asarray(got), np.asarray(base))))
        return worst

    return evaluate
