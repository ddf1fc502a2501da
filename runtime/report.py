"""The zeroing report: what the compiler removed (static, from the manifest) and what one request skipped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Report"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Report:
    """What LayerZero saved on one request.

    Attributes:
        total_layers: Layers of the source model (manifest ``layers.total``; 0 when unknown).
        zeroed_layers: Layers the compiler removed (``len(manifest layers.zeroed)``).
        zeroed_params_ratio: ``1 - params_after / params_before`` from the manifest; 0.0 when unknown.
        zeroed_paths: Scopes removed at compile time (manifest ``layers.zeroed``); the same for every request.
        skipped_paths: Dynamic paths (``layerzero::mask::<path>`` outputs) whose mask was all zero on this
            request, i.e. skipped for every token.
        fallback_triggered: The guard re-ran this request on the reference model.
        routing_confidence: The router's confidence for this request, when the model reports one.
        masks: Per-path mask arrays, filled only when the caller asked (``Engine.run(..., masks=True)``).
    """

    total_layers: int = 0
    zeroed_layers: int = 0
    zeroed_params_ratio: float = 0.0
    zeroed_paths: list[str] = dataclasses.field(default_factory=list)
    skipped_paths: list[str] = dataclasses.field(default_factory=list)
    fallback_triggered: bool = False
    routing_confidence: float | None = None
    masks: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> Report:
        """The static part of the report, from a manifest (missing or malformed fields count as unknown)."""
        layers = manifest.get("layers")
        layers = layers if isinstance(layers, Mapping) else {}
        zeroed = layers.get("zeroed")
        zeroed_paths = [str(p) for p in zeroed] if isinstance(zeroed, list) else []
        total = layers.get("total")
        total_layers = total if isinstance(total, int) and not isinstance(total, bool) else 0
        return cls(
            total_layers=total_layers,
            zeroed_layers=len(zeroed_paths),
            zeroed_params_ratio=_zeroed_params_ratio(manifest.get("stats")),
            zeroed_paths=zeroed_paths,
        )

    def copy(self) -> Report:
        """An independent copy (lists and the masks dict are copied; mask arrays are shared)."""
        return dataclasses.replace(
            self,
            zeroed_paths=list(self.zeroed_paths),
            skipped_paths=list(self.skipped_paths),
            masks=dict(self.masks),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; mask arrays become nested lists."""
        return {
            "total_layers": int(self.total_layers),
            "zeroed_layers": int(self.zeroed_layers),
            "zeroed_params_ratio": float(self.zeroed_params_ratio),
            "zeroed_paths": list(self.zeroed_paths),
            "skipped_paths": list(self.skipped_paths),
            "fallback_triggered": bool(self.fallback_triggered),
            "routing_confidence": None if self.routing_confidence is None else float(self.routing_confidence),
            "masks": {path: np.asarray(mask).tolist() for path, mask in self.masks.items()},
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One line for humans, e.g. ``zeroed 1/4 layers, 23.1% of parameters; skipped 2 paths``."""
        text = f"zeroed {self.zeroed_layers}/{self.total_layers} layers, {self.zeroed_params_ratio:.1%} of parameters"
        if self.skipped_paths:
            n = len(self.skipped_paths)
            text += f"; skipped {n} path{'s' if n != 1 else ''} on this request"
        if self.routing_confidence is not None:
            text += f"; routing confidence {self.routing_confidence:.3f}"
        if self.fallback_triggered:
            text += "; fell back to the reference model"
        return text


def _zeroed_params_ratio(stats: object) -> float:
    if not isinstance(stats, Mapping):
        return 0.0
    before, after = stats.get("params_before"), stats.get("params_after")
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or before <= 0:
        return 0.0
    return 1.0 - float(after) / float(before)
