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

   ``refine`` (optional, ``--activation-refine N``): at an allocation, each unit's groups (``refine_unit``: the
   group, its layer, or its projection kind) one ``step`` up and one down, the deviation measured there (the other
   groups' sparsity included, no additivity assumed); sparsity moved from the units whose step down saves most to
   those whose step up costs least, the model-wide level held, kept only when the measured deviation falls.
   ``collect_activations`` and ``output_deviation`` live in ``activation_runs`` (re-exported here).

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
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from layerzero.activation_runs import Evaluate, collect_activations, output_deviation
from layerzero.errors import InvalidInputError
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
    #: ``refine``: the deviation measured at the start and after each round that moved sparsity.
    trace: list[float] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "method": self.method,
            "target": self.target,
            "sparsity": self.sparsity,
            "levels": dict(self.levels),
            "curve": [[float(s), float(e)] for s, e in self.curve],
            "chosen": self.chosen,
            "deviation": self.deviation,
            "trace": self.trace,
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


#: ``refine``'s units: the groups moved together (one shift of level for all of them).
REFINE_UNITS = ("group", "layer", "kind")


def refine_unit(name: str, by: str) -> str:
    """The unit of group ``name`` (``model.layers.<i>.<...>.<kind>``): itself, its layer, or its projection kind."""
    if by == "group":
        return name
    parts = name.split(".")
    if by == "kind":
        return parts[-1]
    if by == "layer":
        i = parts.index("layers") + 2 if "layers" in parts else len(parts) - 1
        return ".".join(parts[:i])
    raise InvalidInputError(f"refine unit {by!r}: expected one of {', '.join(REFINE_UNITS)}")


def refine(groups: Sequence[GroupSamples], alloc: Allocation, evaluate: Evaluate, criterion: str = "wina",
           step: float = 0.05, rounds: int = 2, cap: float = 0.95, by: str = "kind") -> Allocation:  # fmt: skip
    """Move sparsity between units of groups (``by``: ``refine_unit``) at the allocation, the model-wide level held.

    Each round measures, at the current levels, the deviation with one unit's groups all ``step`` higher and all
    ``step`` lower (clamped to [0, ``cap``]), i.e. each unit's marginal cost and saving per parameter at the
    operating point, the other groups' sparsity included; ``_transport`` moves parameter budget from the units
    whose step down saves most to those whose step up costs least while that gains; the moved allocation is kept
    when its measured deviation is lower (else the move halved, then quartered; else stop). A round costs at most
    2 x units + 3 evaluations (plus one at the start). Few units (``kind``: 4 in a decoder) are measured by large
    changes of the output, which the calibration requests estimate well; one unit per group fits the evaluation's
    few tokens (bench/README: measured worse on other text)."""
    _check_target(cap)
    named = {g.name: g for g in groups}
    units: dict[str, list[GroupSamples]] = {}
    for g in groups:
        units.setdefault(refine_unit(g.name, by), []).append(g)
    levels = {g.name: float(alloc.levels[g.name]) for g in groups}

    def measure(lv: Mapping[str, float]) -> float:
        return float(evaluate({n: named[n].thresholds_at(v, criterion) for n, v in lv.items() if v > 0}))

    def shifted(members: Sequence[GroupSamples], delta: float) -> tuple[dict[str, float], float]:
        moved = {g.name: min(cap, max(0.0, levels[g.name] + delta)) for g in members}
        return moved, sum(g.params * (moved[g.name] - levels[g.name]) for g in members)

    base = measure(levels)
    trace = [base]
    for _ in range(rounds):
        up: dict[str, tuple[float, float]] = {}
        down: dict[str, tuple[float, float]] = {}
        shifts: dict[str, dict[str, dict[str, float]]] = {}
        for key, members in units.items():
            for sign, side in ((1.0, up), (-1.0, down)):
                moved, budget = shifted(members, sign * step)
                if abs(budget) > 1e-9:
                    change = (measure({**levels, **moved}) - base) / abs(budget)
                    side[key] = (change if sign > 0 else -change, abs(budget))
                    shifts.setdefault(key, {})["u" if sign > 0 else "d"] = {
                        n: (v - levels[n]) / abs(budget) for n, v in moved.items()}  # fmt: skip
        moves = _transport(up, down)
        if not moves:
            break
        for fraction in (1.0, 0.5, 0.25):
            trial = dict(levels)
            for key, amount in moves.items():  # the unit's clamped shift, scaled to the budget moved
                for n, per in shifts[key]["u" if amount > 0 else "d"].items():
                    trial[n] = min(cap, max(0.0, trial[n] + fraction * abs(amount) * per))
            got = measure(trial)
            if got < base:
                levels, base = trial, got
                break
        else:
            break
        trace.append(base)
    thresholds = {g.name: g.thresholds_at(levels[g.name], criterion) for g in groups}
    total = sum(g.params for g in groups) or 1
    realized = sum(g.params * g.realized(thresholds[g.name], criterion) for g in groups) / total
    return dataclasses.replace(alloc, method=f"{alloc.method}+refine", thresholds=thresholds, levels=levels,
                               sparsity=float(realized), deviation=base, trace=trace)  # fmt: skip


def _transport(up: Mapping[str, tuple[float, float]], down: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Parameter budget moved from the groups whose last step saves the most deviation per parameter to those whose
    next step costs the least, while that gains: group -> signed parameters sparsified (sum 0)."""
    ups = sorted(up, key=lambda n: up[n][0])
    downs = sorted(down, key=lambda n: -down[n][0])
    role: dict[str, str] = {}
    moves: dict[str, float] = {}
    room = {**{("u", n): up[n][1] for n in up}, **{("d", n): down[n][1] for n in down}}
    i = j = 0
    while i < len(ups) and j < len(downs):
        u, d = ups[i], downs[j]
        if role.get(u, "u") != "u" or (u == d and u not in role):  # a group only gives or only takes
            i += 1
            continue
        if role.get(d, "d") != "d":
            j += 1
            continue
        if not up[u][0] < down[d][0]:
            break
        amount = min(room[("u", u)], room[("d", d)])
        moves[u] = moves.get(u, 0.0) + amount
        moves[d] = moves.get(d, 0.0) - amount
        role[u], role[d] = "u", "d"
        room[("u", u)] -= amount
        room[("d", d)] -= amount
        if room[("u", u)] <= 1e-9:
            i += 1
        if room[("d", d)] <= 1e-9:
            j += 1
    return {n: a for n, a in moves.items() if abs(a) > 1e-9}
