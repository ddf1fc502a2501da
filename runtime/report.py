"""The zeroing report: what the compiler removed (static, from the manifest) and what one request skipped;
the generation report (``Engine.generate``): the new ids, per-step skipped paths, tokens/s."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["GenerateReport", "Generation", "Report", "StepReport", "StepSkips"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Report:
    """What LayerZero saved on one request.

    Attributes:
        total_layers: Layers of the source model (manifest ``layers.total``; 0 when unknown).
        zeroed_layers: Layers the compiler removed (``len(manifest layers.zeroed)``).
        zeroed_params_ratio: ``(params removed at compile time + skipped_params) / params_before``; the static
            part is ``1 - params_after / params_before`` from the manifest; 0.0 when unknown.
        zeroed_paths: Layers removed whole at compile time (manifest ``layers.zeroed``); the same for every
            request.
        removed_scopes: Every scope removed at compile time (manifest ``removed``): whole layers and parts of
            layers (an ``mlp``, a rotary encoding); a part removed counts here, not in ``zeroed_layers``.
        skipped_paths: Dynamic subpaths (e.g. ``model.layers.0.mlp.experts.3``, the manifest's ``dynamic`` entries)
            whose mask column was all zero on this request, i.e. skipped for every token; for a mask output
            without a manifest entry, its path when the whole mask was zero.
        skipped_params: Parameters of the subpaths skipped on this request (manifest ``dynamic`` params).
        params_before: Parameters of the source model (manifest ``stats.params_before``; 0 when unknown).
        fallback_triggered: The guard re-ran this request on the reference model.
        routing_confidence: The mean over tokens (and routers) of each token's top-1 routing probability
            (``layerzero::router::<path>`` outputs); None when the model has no router output.
        masks: Per-path mask arrays, filled only when the caller asked (``Engine.run(..., masks=True)``).
        activation_sparsity: Per activation-sparsity group (manifest ``dynamic`` entries of kind ``"activation"``),
            the fraction of its input channels zeroed on this request: ``1 - mean(kept) / channels`` over the token
            rows (``layerzero::mask::<group>`` holds each row's kept count). The weight rows of the zeroed channels
            are not read: ``skipped_params`` counts ``params × that fraction`` (rounded), so they reach
            ``zeroed_params_ratio``.
    """

    total_layers: int = 0
    zeroed_layers: int = 0
    zeroed_params_ratio: float = 0.0
    zeroed_paths: list[str] = dataclasses.field(default_factory=list)
    skipped_paths: list[str] = dataclasses.field(default_factory=list)
    fallback_triggered: bool = False
    routing_confidence: float | None = None
    masks: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    skipped_params: int = 0
    params_before: int = 0
    removed_scopes: list[str] = dataclasses.field(default_factory=list)
    activation_sparsity: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> Report:
        """The static part of the report, from a manifest (missing or malformed fields count as unknown)."""
        layers = manifest.get("layers")
        layers = layers if isinstance(layers, Mapping) else {}
        zeroed = layers.get("zeroed")
        zeroed_paths = [str(p) for p in zeroed] if isinstance(zeroed, list) else []
        total = layers.get("total")
        total_layers = total if isinstance(total, int) and not isinstance(total, bool) else 0
        removed = manifest.get("removed")
        removed_scopes = [
            str(r["scope"])
            for r in (removed if isinstance(removed, list) else [])
            if isinstance(r, Mapping) and isinstance(r.get("scope"), str)
        ]
        return cls(
            total_layers=total_layers,
            zeroed_layers=len(zeroed_paths),
            zeroed_params_ratio=_zeroed_params_ratio(manifest.get("stats")),
            zeroed_paths=zeroed_paths,
            params_before=_params_before(manifest.get("stats")),
            removed_scopes=removed_scopes,
        )

    def add_dynamic(
        self,
        outputs: Mapping[str, np.ndarray],
        dynamic: object,
        *,
        mask_prefix: str,
        router_prefix: str,
        keep_masks: bool = False,
    ) -> None:
        """Fill the per-request fields from one run's mask and router outputs (by output name).

        ``dynamic`` is the manifest's ``dynamic`` list (or ``index_dynamic`` of it, computed once per engine):
        each entry maps a mask output to its subpaths (one per mask's last axis, or the whole mask for a single
        subpath) and their parameter counts.
        """
        entries = dynamic if isinstance(dynamic, dict) else index_dynamic(dynamic)
        confidences: list[np.ndarray] = []
        for name, value in outputs.items():
            array = np.asarray(value)
            if name.startswith(router_prefix):
                if array.size:
                    confidences.append(array.astype(np.float64).reshape(-1))
                continue
            if not name.startswith(mask_prefix):
                continue
            entry = entries.get(name)
            path = entry["path"] if entry is not None else name[len(mask_prefix) :]
            if keep_masks:
                self.masks[path] = array
            # Skipped = skipped for every token of the request; an empty mask (no tokens) is no evidence.
            if entry is None:
                if array.size and not array.any():
                    self.skipped_paths.append(path)
                continue
            subpaths, params = entry["subpaths"], entry["params"]
            if entry.get("kind") == "activation":
                self._add_activation(entry, array)
                continue
            if len(subpaths) == 1:
                if array.size and not array.any():
                    self.skipped_paths.append(str(subpaths[0]))
                    self.skipped_params += int(params[0]) if params else 0
                continue
            if not array.size:
                continue
            # One reduction per mask, not one per subpath: a decode step of 8 layers x 32 experts made 256
            # numpy calls here (~2 ms a step on this machine, beside a ~26 ms step); the skipped subpaths and
            # their parameters are then taken from index_dynamic's arrays (no Python loop over them either).
            dead = np.flatnonzero(~array.reshape(-1, array.shape[-1]).any(axis=0)[: len(subpaths)])
            if dead.size:
                names, counts = entry.get("_paths"), entry.get("_params")
                if names is None or counts is None:
                    names, counts = _subpath_arrays(subpaths, params)
                self.skipped_paths.extend(names[dead].tolist())
                self.skipped_params += int(counts[dead].sum())
        if confidences:
            self.routing_confidence = float(np.concatenate(confidences).mean())
        if self.skipped_params and self.params_before > 0:
            self.zeroed_params_ratio += self.skipped_params / self.params_before

    def _add_activation(self, entry: Mapping[str, Any], kept: np.ndarray) -> None:
        """One activation group's kept counts (one per token row) -> its realized sparsity, the rows not read."""
        detail = entry.get("detail") if isinstance(entry.get("detail"), Mapping) else {}
        channels = detail.get("channels")
        if not kept.size or not isinstance(channels, int) or isinstance(channels, bool) or channels <= 0:
            return
        zeroed = float(1.0 - kept.astype(np.float64).mean() / channels)
        self.activation_sparsity[str(entry["path"])] = zeroed
        params = entry["params"]
        self.skipped_params += round(zeroed * sum(int(p) for p in params))

    def copy(self) -> Report:
        """An independent copy (lists and the masks dict are copied; mask arrays are shared)."""
        return dataclasses.replace(
            self,
            zeroed_paths=list(self.zeroed_paths),
            skipped_paths=list(self.skipped_paths),
            masks=dict(self.masks),
            removed_scopes=list(self.removed_scopes),
            activation_sparsity=dict(self.activation_sparsity),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; mask arrays become nested lists."""
        out = {
            "total_layers": int(self.total_layers),
            "zeroed_layers": int(self.zeroed_layers),
            "zeroed_params_ratio": float(self.zeroed_params_ratio),
            "zeroed_paths": list(self.zeroed_paths),
            "skipped_paths": list(self.skipped_paths),
            "fallback_triggered": bool(self.fallback_triggered),
            "routing_confidence": None if self.routing_confidence is None else float(self.routing_confidence),
            "masks": {path: np.asarray(mask).tolist() for path, mask in self.masks.items()},
            "skipped_params": int(self.skipped_params),
            "params_before": int(self.params_before),
            "removed_scopes": list(self.removed_scopes),
            "summary": self.summary(),
        }
        if self.activation_sparsity:  # only a model with activation sparsity has the key (as run_bundle, the C++
            # runner, writes it: the same JSON for every bundle)
            out["activation_sparsity"] = {k: float(v) for k, v in self.activation_sparsity.items()}
        return out

    def summary(self) -> str:
        """One line for humans, e.g. ``zeroed 1/4 layers, 23.1% of parameters; skipped 2 paths``.

        ``zeroed N/M layers`` counts layers removed whole; scopes removed inside a layer (an ``mlp``) follow as
        ``and K parts of layers (...)`` (the parameter share counts both).
        """
        text = f"zeroed {self.zeroed_layers}/{self.total_layers} layers{removed_parts(self)}"
        text += f", {self.zeroed_params_ratio:.1%} of parameters"
        if self.skipped_paths:
            n = len(self.skipped_paths)
            text += f"; skipped {n} path{'s' if n != 1 else ''} on this request"
        if self.activation_sparsity:
            mean = sum(self.activation_sparsity.values()) / len(self.activation_sparsity)
            text += f"; activations {mean:.1%} zeroed (mean of {len(self.activation_sparsity)} groups)"
        if self.routing_confidence is not None:
            text += f"; routing confidence {self.routing_confidence:.3f}"
        if self.fallback_triggered:
            text += "; fell back to the reference model"
        return text


def removed_parts(report: Any) -> str:
    """`` and 1 part of a layer (model.layers.1.mlp)`` for the scopes removed that are no whole layer, or ""."""
    whole = set(report.zeroed_paths)
    parts = [s for s in report.removed_scopes if s not in whole]
    if not parts:
        return ""
    shown = ", ".join(parts[:3]) + (f", … {len(parts) - 3} more" if len(parts) > 3 else "")
    return f" and {len(parts)} {'part of a layer' if len(parts) == 1 else 'parts of layers'} ({shown})"


def _zeroed_params_ratio(stats: object) -> float:
    if not isinstance(stats, Mapping):
        return 0.0
    before, after = stats.get("params_before"), stats.get("params_after")
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or before <= 0:
        return 0.0
    # A compile can add a few parameters (e.g. a run-time threshold scalar): nothing zeroed is 0, not negative.
    return max(0.0, 1.0 - float(after) / float(before))


def _params_before(stats: object) -> int:
    before = stats.get("params_before") if isinstance(stats, Mapping) else None
    return int(before) if isinstance(before, (int, float)) and not isinstance(before, bool) and before > 0 else 0


class StepSkips:
    """A decode step's ``skipped_paths`` and masks from its mask outputs, without a whole ``Report``: what
    ``Report.add_dynamic`` finds, in one reduction over every mask (a routed model's masks, ``[tokens, experts]``
    per layer, side by side) instead of one per mask: the generate loop's per-step cost, ~0.1-0.2 ms of a ~5 ms
    int4 decode step here, is mostly numpy calls.

    It applies when every mask output has a manifest entry with several subpaths, none of kind ``activation``,
    all of the same count (a MoE's layers); then ``__call__`` gives the same paths in the same order as
    ``add_dynamic``. Otherwise, or when a step's masks are not of one shape, ``__call__`` returns None and the
    caller takes the whole report.
    """

    def __init__(self, outputs: list[str], index: Mapping[str, dict], mask_prefix: str) -> None:
        self.masks = [n for n in outputs if n.startswith(mask_prefix)]
        entries = [index.get(n) for n in self.masks]
        ok = bool(entries) and all(
            e is not None and e.get("kind") != "activation" and len(e["subpaths"]) > 1 for e in entries
        )
        widths = {len(e["subpaths"]) for e in entries if e is not None}
        self.applies = ok and len(widths) == 1
        # Every mask an activation group's kept counts: they record a realized sparsity, never a skipped path
        # (``Report._add_activation``), so a step skips nothing and its masks matter only when asked for.
        self.activation_only = bool(entries) and all(e is not None and e.get("kind") == "activation" for e in entries)
        self.paths = [str(e["path"]) for e in entries] if ok or self.activation_only else []  # type: ignore[index]
        self.width = widths.pop() if self.applies else 0
        self._names = np.concatenate([e["_paths"] for e in entries]) if self.applies else None  # type: ignore[index]

    def __call__(self, values: Mapping[str, np.ndarray]) -> tuple[list[str], dict[str, np.ndarray]] | None:
        """``(skipped paths, {path: mask})`` of one step's outputs by name, or None (see the class doc)."""
        if not self.applies:
            return None
        arrays = [values[n] for n in self.masks]
        first = arrays[0].shape
        if not first or first[-1] != self.width or any(a.shape != first for a in arrays):
            return None
        return self.from_side(np.concatenate(arrays, axis=-1))

    @property
    def side_width(self) -> int:
        """The last dimension of the masks side by side (``side``)."""
        return self.width * len(self.masks)

    def side(self, values: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """The step's masks side by side along their last axis (a new array: the decode loop keeps it until after
        its last step, when the outputs it was copied from hold another step's values), or None where they are not
        of one shape of ``width`` columns (then ``__call__``'s None)."""
        if not self.applies:
            return None
        try:
            side = np.concatenate([values[n] for n in self.masks], axis=-1)
        except ValueError:
            return None
        return side if side.ndim >= 2 and side.shape[-1] == self.side_width else None

    def from_side(self, side: np.ndarray) -> tuple[list[str], dict[str, np.ndarray]]:
        """``__call__``'s result from ``side``."""
        masks = dict(zip(self.paths, np.split(side, len(self.masks), axis=-1), strict=True))
        if not side.size:  # no tokens: no evidence (add_dynamic's rule)
            return [], masks
        dead = np.flatnonzero(~side.reshape(-1, side.shape[-1]).any(axis=0))
        return (self._names[dead].tolist() if dead.size else []), masks  # type: ignore[index]


def index_dynamic(dynamic: object) -> dict[str, dict]:
    """The manifest's ``dynamic`` list keyed by mask output name (invalid entries left out), each entry with its
    subpaths and parameter counts as arrays (``_paths``, ``_params``: what ``add_dynamic`` indexes per step)."""
    index = {}
    for e in dynamic if isinstance(dynamic, list) else []:
        if _valid_entry(e):
            names, counts = _subpath_arrays(e["subpaths"], e["params"])
            index[e["mask_output"]] = {**e, "_paths": names, "_params": counts}
    return index


def _subpath_arrays(subpaths: list, params: list) -> tuple[np.ndarray, np.ndarray]:
    """Subpath names (str, an object array) and their parameter counts (int64, 0 where ``params`` is short)."""
    names = np.empty(len(subpaths), dtype=object)
    names[:] = [str(p) for p in subpaths]
    counts = np.zeros(len(subpaths), dtype=np.int64)
    for j, p in enumerate(params[: len(subpaths)]):
        counts[j] = int(p)
    return names, counts


def _valid_entry(entry: object) -> bool:
    return (
        isinstance(entry, Mapping)
        and isinstance(entry.get("mask_output"), str)
        and isinstance(entry.get("path"), str)
        and isinstance(entry.get("subpaths"), list)
        and isinstance(entry.get("params"), list)
        and len(entry["subpaths"]) > 0
    )


@dataclasses.dataclass
class StepReport:
    """One forward pass: the tokens it ran (the prompt on the first step, then one), what it skipped."""

    tokens: int
    token_id: int  # the token it produced
    seconds: float
    skipped_paths: list[str]
    masks: dict[str, list] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateReport:
    """One request. ``tokens_per_s`` is new tokens / total time; ``decode_tokens_per_s`` leaves the prefill out.

    The static part (``total_layers``, ``zeroed_layers``, ``zeroed_paths``, ``removed_scopes``,
    ``zeroed_params_ratio``) comes from the bundle's manifest; ``skipped_paths`` are the dynamic paths no step
    of this request ran. ``batch_rows`` > 1: the request was one row of a batch; its ``steps`` are the steps
    this row took, but what a step skipped (and its masks) is the batch's: a path no row's token ran.
    """

    prompt_tokens: int
    new_tokens: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "max_tokens"
    time_to_first_token_s: float
    total_s: float
    tokens_per_s: float
    decode_tokens_per_s: float | None
    cache: bool
    total_layers: int
    zeroed_layers: int
    zeroed_paths: list[str]
    zeroed_params_ratio: float
    skipped_paths: list[str]
    steps: list[StepReport]
    removed_scopes: list[str] = dataclasses.field(default_factory=list)
    batch_rows: int = 1

    def to_dict(self, steps: bool = True) -> dict[str, Any]:
        """All fields; ``steps=False`` gives the compact form instead of the per-step list (which holds every
        step's skipped paths, about 1 MB for 128 tokens of a 32-expert model): ``step_count`` and
        ``skipped_steps``, for each dynamic path the number of steps that skipped it."""
        doc = dataclasses.asdict(self)
        if not steps:
            del doc["steps"]
            doc["step_count"] = len(self.steps)
            doc["skipped_steps"] = self.skipped_steps()
        return doc

    def skipped_steps(self) -> dict[str, int]:
        """For each dynamic path skipped on some step: on how many of this request's steps (sorted by path)."""
        counts: dict[str, int] = {}
        for step in self.steps:
            for path in step.skipped_paths:
                counts[path] = counts.get(path, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        decode = f", decode {self.decode_tokens_per_s:.1f} tok/s" if self.decode_tokens_per_s else ""
        return (
            f"{self.new_tokens} new tokens ({self.stop_reason}) in {self.total_s * 1e3:.1f} ms: "
            f"{self.tokens_per_s:.1f} tok/s{decode}, first token {self.time_to_first_token_s * 1e3:.1f} ms; "
            f"{self.zeroed_layers}/{self.total_layers} layers zeroed{removed_parts(self)}, "
            f"{self.zeroed_params_ratio:.1%} of parameters removed, "
            f"{len(self.skipped_paths)} paths skipped on every step"
            + (f" (of the batch of {self.batch_rows})" if self.batch_rows > 1 else "")
        )


@dataclasses.dataclass
class Generation:
    """The generated ids (new tokens only), the prompt, and the report."""

    ids: list[int]
    prompt_ids: list[int]
    report: GenerateReport
