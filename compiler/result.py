"""What a compile produced: ``CompileResult`` (and its manifest), ``RemovedScope``, ``PipelineResult``.

Data only, below both the compile (``compile.py``, which makes them) and the targets (``targets/``, which write
a bundle from a ``CompileResult``), so neither imports the other for these types.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir

from layerzero import __version__
from layerzero.options import CompileOptions
from layerzero.passes import BypassedLayer
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.summary import ModelSummary
from layerzero.verify import VerificationResult

if TYPE_CHECKING:
    from layerzero.solidify_plan import SolidifyPlan

__all__ = ["CompileResult", "PipelineResult", "RemovedScope"]


@dataclasses.dataclass
class PipelineResult:
    iterations: int
    converged: bool
    modified_by: dict[str, int]  # pass name -> iterations in which it changed the model
    bypassed: list[BypassedLayer]


@dataclasses.dataclass
class RemovedScope:
    scope: str
    kind: str  # "declared-flag" | "consumed-flag" | "folded"
    params: int
    nodes: int


@dataclasses.dataclass
class CompileResult:
    model: ir.Model
    options: CompileOptions
    before: ModelSummary
    after: ModelSummary
    removed: list[RemovedScope]
    pipeline: PipelineResult
    verification: VerificationResult | None
    seconds: float
    # The runtime backend of the target compiled for (``Target.backend``): the manifest's ``backend``.
    backend: str
    # Paths solidified from a profile (layerzero.solidify_plan): what went, with the profile's numbers; the plan.
    solidified: list[dict] = dataclasses.field(default_factory=list)
    solidify_plan: SolidifyPlan | None = None
    # --weights int4|int8: the format, what was quantized and kept float, and the quantization's own deviation from
    # the float original (``verify.quantization_deviation``; None unverified). None for float weights.
    quantization: dict | None = None
    # --activation-sparsity S: the allocation (compile.py ``sparsify_activations``); None without.
    activation_sparsity: dict | None = None

    @property
    def zeroed_layers(self) -> list[str]:
        layers = set(self.before.layers)
        return [r.scope for r in self.removed if r.scope in layers]

    def manifest(self, source: Path | None, sha256: str | None) -> dict:
        return {
            "layerzero_version": __version__,
            "target": self.options.target,
            # The runtime backend that runs this bundle (Engine.load picks it from here).
            "backend": self.backend,
            "source": {"path": None if source is None else str(source.resolve()), "sha256": sha256},
            "options": self.options.to_dict(),
            "stats": {
                "nodes_before": self.before.nodes,
                "nodes_after": self.after.nodes,
                "params_before": self.before.params,
                "params_after": self.after.params,
                "structured_params_removed": self.after.structured_params_removed,
                "compile_seconds": round(self.seconds, 3),
                "iterations": self.pipeline.iterations,
            },
            "layers": {"total": len(self.before.layers), "zeroed": self.zeroed_layers},
            "removed": [dataclasses.asdict(r) for r in self.removed],
            "dynamic": [d.to_dict() for d in read_dynamic_paths(self.model)],
            "solidified": self.solidified,
            "quantization": self.quantization,
            "activation_sparsity": self.activation_sparsity,
            "verification": None if self.verification is None else self.verification.to_dict(),
        }
