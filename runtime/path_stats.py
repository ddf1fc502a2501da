"""Profiling counters over requests: how often each path runs, how long it stays skipped, what skipping costs.

    profiler = Profiler(engine)                    # a bundle's Engine
    for feeds in requests:
        profiler.run(feeds)                        # engine.run(feeds, masks=True), counted
    meter = ImpactMeter(variant)                   # optional: the bundle's force-off variant, as an Engine
    for feeds in requests[:8]:
        profiler.add_impact(meter.measure(feeds))
    document = profiler.to_dict()                  # the profile (PROFILE_FORMAT, PROFILE_VERSION)

Paths: every dynamic subpath of the manifest's ``dynamic`` section (a MoE expert ``<path>.experts.<e>``, a
gated branch, a group), one column of its mask ``layerzero::mask::<path>`` (True = runs), and every layer
the compiler removed (manifest ``removed``: always skipped).

Counters per path: tokens and requests run / skipped (a request is skipped when no token of it ran the
path) and ``zeroing_stability``, the longest run of consecutive skips, in tokens (token order within a
request, requests in the order seen) and in requests. A per-request decision (a scalar gate, a group) counts
for every token of the request. A request's tokens: the size of its largest per-token mask column, else of
its first input (all dims of an integer input, token ids; all but the last of a float one, a hidden state).

``zeroing_impact``: the relative L2 change (``‖y_off − y‖ / ‖y‖``, ``layerzero.runtime.guard.relative_l2``) of
the path's block output (the value it writes) and of the model output (the largest over the user outputs)
when the path alone is forced off, the largest and the mean over the sampled requests. It is measured on
the force-off variant of the compiled model (``layerzero.passes.force_off``): one graph input
``layerzero::force_off::<path>`` per path (bool per subpath; True = off) and one output
``layerzero::block::<path>``. This module only needs an ``Engine`` of it: the compiler builds the variant.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from layerzero import __version__
from layerzero.contract import BLOCK_PREFIX, FORCE_OFF_PREFIX, MASK_PREFIX
from layerzero.errors import InvalidInputError
from layerzero.runtime.engine import Engine, Result
from layerzero.runtime.guard import relative_l2

__all__ = [
    "BLOCK_PREFIX",
    "FORCE_OFF_PREFIX",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ImpactMeter",
    "PathStats",
    "Profiler",
    "iter_requests",
    "load_profile",
]

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "layerzero-profile"
PROFILE_VERSION = 1


@dataclasses.dataclass
class PathStats:
    """One path's counters (see the module doc)."""

    path: str  # the subpath, e.g. "layers.0.moe.experts.3"; a removed layer's scope
    parent: str  # the dynamic path it belongs to (its mask), e.g. "layers.0.moe"; a removed layer: its scope
    kind: str  # "moe" | "gate" | "group" | "static"
    index: int = 0  # the mask column
    params: int = 0
    removed_kind: str | None = None  # static: the manifest's kind ("declared-flag", "folded", "solidified", ...)
    tokens_run: int = 0
    tokens_skipped: int = 0
    requests_run: int = 0
    requests_skipped: int = 0
    stability_tokens: int = 0
    stability_requests: int = 0
    impact_block: float | None = None
    impact_model: float | None = None
    impact_block_mean: float | None = None
    impact_model_mean: float | None = None
    impact_samples: int = 0
    impact_source: str | None = None  # "measured" | "verification" | "exact"
    _run_tokens: int = dataclasses.field(default=0, repr=False)
    _run_requests: int = dataclasses.field(default=0, repr=False)
    _block_sum: float = dataclasses.field(default=0.0, repr=False)
    _model_sum: float = dataclasses.field(default=0.0, repr=False)
    _block_samples: int = dataclasses.field(default=0, repr=False)

    def add(self, ran: np.ndarray, tokens: int) -> None:
        """One request: ``ran`` is the path's mask column (True = ran), per token in order, or a scalar
        decision standing for all ``tokens`` of the request."""
        ran = np.asarray(ran, dtype=bool)
        if ran.ndim == 0:
            ran = np.full(tokens, bool(ran))
        ran = ran.reshape(-1)
        n = int(ran.size)
        runs = int(np.count_nonzero(ran))
        self.tokens_run += runs
        self.tokens_skipped += n - runs
        if runs:
            self.requests_run += 1
            self._run_requests = 0
            first = int(np.argmax(ran))
            last = n - 1 - int(np.argmax(ran[::-1]))
            self.stability_tokens = max(self.stability_tokens, self._run_tokens + first, _longest_false(ran))
            self._run_tokens = n - 1 - last
        else:
            self.requests_skipped += 1
            self._run_requests += 1
            self._run_tokens += n
        self.stability_tokens = max(self.stability_tokens, self._run_tokens)
        self.stability_requests = max(self.stability_requests, self._run_requests)

    def add_impact(self, block: float | None, model: float) -> None:
        self.impact_samples += 1
        self.impact_source = "measured"
        self.impact_model = model if self.impact_model is None else max(self.impact_model, model)
        self._model_sum += model
        self.impact_model_mean = self._model_sum / self.impact_samples
        if block is not None:
            self._block_samples += 1
            self._block_sum += block
            self.impact_block = block if self.impact_block is None else max(self.impact_block, block)
            self.impact_block_mean = self._block_sum / self._block_samples

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "parent": self.parent,
            "kind": self.kind,
            "index": self.index,
            "params": self.params,
            **({"removed_kind": self.removed_kind} if self.removed_kind is not None else {}),
            "tokens": {"run": self.tokens_run, "skipped": self.tokens_skipped},
            "requests": {"run": self.requests_run, "skipped": self.requests_skipped},
            "zeroing_stability": {"tokens": self.stability_tokens, "requests": self.stability_requests},
            "zeroing_impact": {
                "block": _finite(self.impact_block),
                "model": _finite(self.impact_model),
                "block_mean": _finite(self.impact_block_mean),
                "model_mean": _finite(self.impact_model_mean),
                "samples": self.impact_samples,
                "source": self.impact_source,
            },
        }


def _longest_false(ran: np.ndarray) -> int:
    """The longest run of False in a 1-D bool array."""
    if not ran.size:
        return 0
    # Positions of the Trues, with sentinels before and after: the gaps between them are the runs of False.
    edges = np.concatenate([[-1], np.flatnonzero(ran), [ran.size]])
    return int((np.diff(edges) - 1).max())


def _finite(value: float | None) -> float | str | None:
    """JSON has no inf: an infinite impact (a zero output that changed) is written as the string "inf"."""
    if value is None:
        return None
    return float(value) if np.isfinite(value) else "inf"


class Profiler:
    """Counters over the requests a bundle's ``Engine`` runs (see the module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        manifest = engine.manifest
        self.requests = 0
        self.tokens = 0
        self._entries: list[dict] = []
        self.paths: dict[str, PathStats] = {}
        for entry in manifest.get("dynamic") or []:
            if not isinstance(entry, Mapping) or not entry.get("subpaths"):
                continue
            self._entries.append(dict(entry))
            params = list(entry.get("params") or [])
            for j, subpath in enumerate(entry["subpaths"]):
                self.paths[str(subpath)] = PathStats(
                    path=str(subpath),
                    parent=str(entry["path"]),
                    kind=str(entry.get("kind", "dynamic")),
                    index=j,
                    params=int(params[j]) if j < len(params) else 0,
                )
        self._static: list[PathStats] = []
        for removed in manifest.get("removed") or []:
            if not isinstance(removed, Mapping) or not isinstance(removed.get("scope"), str):
                continue
            if removed.get("kind") == "solidified":
                continue  # listed by its subpath below
            stats = PathStats(
                path=removed["scope"],
                parent=removed["scope"],
                kind="static",
                params=int(removed.get("params") or 0),
                removed_kind=str(removed.get("kind") or "folded"),
            )
            stats.impact_source, stats.impact_model = _static_impact(manifest, stats)
            self._static.append(stats)
            self.paths.setdefault(stats.path, stats)
        # Paths solidified at compile time (from an earlier profile), by subpath: a later solidify keeps them out.
        for record in manifest.get("solidified") or []:
            if not isinstance(record, Mapping) or not isinstance(record.get("subpath"), str):
                continue
            if record["subpath"] in self.paths:
                continue
            stats = PathStats(
                path=str(record["subpath"]),
                parent=str(record.get("path") or record["subpath"]),
                kind="static",
                params=int(record.get("params") or 0),
                removed_kind="solidified",
            )
            impact = (record.get("impact") or {}).get("model")
            stats.impact_source, stats.impact_model = "profile", impact if isinstance(impact, (int, float)) else None
            self._static.append(stats)
            self.paths[stats.path] = stats

    def run(self, feeds: Mapping[str, Any]) -> Result:
        """Run one request on the engine (masks on) and count it."""
        result = self.engine.run(feeds, masks=True)
        self.observe(result.report.masks, feeds)
        return result

    def observe(self, masks: Mapping[str, np.ndarray], feeds: Mapping[str, Any] | None = None) -> None:
        """Count one request from its masks (``Report.masks``: path -> mask array)."""
        columns: dict[str, np.ndarray] = {}
        for entry in self._entries:
            mask = masks.get(entry["path"])
            if mask is None:
                mask = masks.get(entry.get("mask_output", "").removeprefix(MASK_PREFIX))
            if mask is None:
                continue
            mask = np.asarray(mask).astype(bool)
            subpaths = entry["subpaths"]
            for j, subpath in enumerate(subpaths):
                columns[subpath] = mask if len(subpaths) == 1 else mask[..., j]
        tokens = max((c.size for c in columns.values() if c.ndim), default=0) or _feed_tokens(feeds)
        for subpath, column in columns.items():
            self.paths[subpath].add(column, tokens)
        for stats in self._static:
            stats.add(np.asarray(False), tokens)
        self.requests += 1
        self.tokens += tokens

    def add_impact(self, impacts: Mapping[str, tuple[float | None, float]]) -> None:
        """One sampled request's impacts: subpath -> (block output change or None, model output change)."""
        for subpath, (block, model) in impacts.items():
            stats = self.paths.get(subpath)
            if stats is not None and stats.kind != "static":
                stats.add_impact(block, model)

    def to_dict(self, *, data: str | None = None, impact_samples: int = 0) -> dict[str, Any]:
        """The profile document (``layerzero profile`` writes it as JSON)."""
        manifest = self.engine.manifest
        source = manifest.get("source") if isinstance(manifest.get("source"), Mapping) else {}
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "layerzero_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "bundle": {
                "path": str(self.engine.path),
                "model_sha256": _sha256(self.engine.model_path),
                "target": manifest.get("target"),
            },
            "source": {"path": source.get("path"), "sha256": source.get("sha256")},
            "traffic": {"requests": self.requests, "tokens": self.tokens, "data": data},
            "impact": {
                "samples": impact_samples,
                "metric": "relative L2 change when the path alone is forced off (‖y_off − y‖ / ‖y‖)",
                "aggregate": "block/model: largest over the sampled requests; *_mean: their mean",
            },
            "blocks": [
                {
                    "path": e["path"],
                    "kind": e.get("kind"),
                    "subpaths": list(e["subpaths"]),
                    **({"top_k": int(e["detail"]["top_k"])} if "top_k" in (e.get("detail") or {}) else {}),
                }
                for e in self._entries
            ],
            "paths": [stats.to_dict() for stats in self.paths.values()],
        }


def _static_impact(manifest: Mapping[str, Any], stats: PathStats) -> tuple[str, float | None]:
    """A removed layer's impact from the manifest: exact zeros cost nothing; a declared flag's bypass costs
    what verification measured for all declared layers together (largest relative deviation)."""
    if stats.removed_kind != "declared-flag":
        return "exact", 0.0
    verification = manifest.get("verification")
    impact = verification.get("impact") if isinstance(verification, Mapping) else None
    if not impact:
        return "verification", None
    values = [float(o.get("max_rel", 0.0)) for o in impact if isinstance(o, Mapping)]
    return "verification", max(values, default=0.0)


def _feed_tokens(feeds: Mapping[str, Any] | None) -> int:
    for value in (feeds or {}).values():
        shape = np.shape(value)
        if not shape:
            return 1
        dims = shape if np.asarray(value).dtype.kind in "iub" else shape[:-1]
        return max(1, int(np.prod(dims, dtype=np.int64)))
    return 1


def _sha256(path: Path) -> str | None:
    from layerzero.runtime.bundle import sha256_file

    try:
        return sha256_file(path)
    except OSError:
        return None


class ImpactMeter:
    """Runs a request on the force-off variant with each path forced off in turn (see the module doc)."""

    def __init__(self, variant: Engine) -> None:
        self.variant = variant
        specs = {s.name: s for s in variant.input_specs}
        self._force = {
            name[len(FORCE_OFF_PREFIX) :]: spec for name, spec in specs.items() if name.startswith(FORCE_OFF_PREFIX)
        }
        self._entries = [
            dict(e)
            for e in variant.manifest.get("dynamic") or []
            if isinstance(e, Mapping) and e.get("path") in self._force
        ]
        self.user_outputs = [n for n in variant.output_names if not n.startswith(BLOCK_PREFIX)]

    @property
    def paths(self) -> list[str]:
        """The subpaths this variant can force off."""
        return [s for e in self._entries for s in e["subpaths"]]

    def _off(self, path: str | None = None, index: int | None = None) -> dict[str, np.ndarray]:
        feeds = {}
        for name, spec in self._force.items():
            array = np.zeros(spec.shape if spec.shape else (), dtype=bool)
            if name == path:
                array[() if array.ndim == 0 else index] = True
            feeds[FORCE_OFF_PREFIX + name] = array
        return feeds

    def measure(self, feeds: Mapping[str, Any]) -> dict[str, tuple[float | None, float]]:
        """subpath -> (relative change of its block output or None, largest relative change of a user output)."""
        base = self.variant.run({**feeds, **self._off()}).outputs
        impacts: dict[str, tuple[float | None, float]] = {}
        for entry in self._entries:
            path = entry["path"]
            block = BLOCK_PREFIX + path
            for j, subpath in enumerate(entry["subpaths"]):
                out = self.variant.run({**feeds, **self._off(path, j)}).outputs
                model = max((relative_l2(out[n], base[n]) for n in self.user_outputs if _numeric(base[n])), default=0.0)
                impacts[subpath] = (relative_l2(out[block], base[block]) if block in out else None, model)
        return impacts


def _numeric(value: Any) -> bool:
    return np.asarray(value).dtype.kind in "fiuc"


def load_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a profile written by ``layerzero profile``; ``InvalidInputError`` names what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInputError(
            f"{path}: profile not found (write one with `layerzero profile BUNDLE --data ...`)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"{path}: not a readable profile (JSON expected): {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise InvalidInputError(f'{path}: not a LayerZero profile (no "format": {PROFILE_FORMAT!r})')
    version = doc.get("version")
    if not isinstance(version, int) or version > PROFILE_VERSION:
        raise InvalidInputError(
            f"{path}: profile version {version!r}; this LayerZero reads versions up to {PROFILE_VERSION} (upgrade it)"
        )
    paths = doc.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, dict) and isinstance(p.get("path"), str) for p in paths):
        raise InvalidInputError(f'{path}: "paths" must be a list of path records')
    return doc


def iter_requests(arrays: Mapping[str, np.ndarray]) -> Iterable[dict[str, np.ndarray]]:
    """Split ``{name: [R, ...]}`` into R requests ``{name: [...]}``."""
    counts = {name: np.shape(a)[0] if np.ndim(a) else None for name, a in arrays.items()}
    if any(c is None for c in counts.values()) or len(set(counts.values())) > 1:
        raise InvalidInputError(
            f"every array needs the same leading request axis, got {', '.join(f'{k}: {v}' for k, v in counts.items())}"
        )
    for r in range(next(iter(counts.values()), 0)):
        yield {name: np.asarray(a[r]) for name, a in arrays.items()}
