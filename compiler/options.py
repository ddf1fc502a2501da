"""Compile options: one dataclass, written into the bundle's manifest."""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["CompileOptions"]


@dataclasses.dataclass
class CompileOptions:
    """What ``compile`` does.

    ``assume_finite``: fold ``x * 0`` (and MatMul/Gemm/Conv with an all-zero weight) to 0. This is
    wrong when x holds NaN or Inf (``NaN * 0`` is NaN), which inference activations normally do not;
    the numerical verification of every compile is the guard. Turn it off for graphs that compute
    with non-finite values on purpose.
    """

    assume_finite: bool = True
    flag_pattern: str = "*.flag"
    max_iterations: int = 10
    fold_max_elements: int = 1 << 20
    verify: bool = True
    atol: float = 1e-4
    rtol: float = 1e-3
    seed: int = 0
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    sample_inputs: Path | None = None
    target: str = "onnxruntime"
    # Verification of models whose weights exceed this runs layer chunks of half this size at a time.
    chunked_verify_bytes: int = 256 << 20
    # Dynamic zeroing (run-time skipping driven by routers and gates).
    dynamic: bool = True
    zeroing_threshold: float = 0.0  # skip a routed expert / gated branch below threshold × the token's largest weight
    max_deviation: float | None = None  # with a threshold > 0: fail verification above this max abs deviation
    # "auto" | "if" (per-expert If subgraphs) | "ort-moe" (com.microsoft.MoE) | "native" (ai.layerzero::MoE kept
    # for liblayerzero_ort.so, `layerzero plugins build`; the bundle then lists it and needs it at run time).
    # auto: native when the library is built, else If below 32 experts and, above, If or ort-moe by a measured cost
    # model (passes/lower_moe_native.py). A block a lowering cannot run falls back to If.
    moe_lowering: str = "auto"
    groups: Path | None = None  # group-mask spec (YAML or JSON)
    # Solidify (layerzero.solidify): remove for good the dynamic paths a profile (`layerzero profile`) found
    # skipped at least `stability_window` consecutive requests (or tokens, `stability_unit`) and whose measured
    # impact (relative L2 change of the model output when forced off) is below `impact_tolerance`.
    profile: Path | None = None
    stability_window: int = 100
    stability_unit: str = "requests"  # "requests" | "tokens"
    impact_tolerance: float = 0.01
    solidify: tuple[str, ...] = ()  # the subpaths to remove (filled from `profile`, or given directly)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["sample_inputs"] = None if self.sample_inputs is None else str(self.sample_inputs)
        out["groups"] = None if self.groups is None else str(self.groups)
        out["profile"] = None if self.profile is None else str(self.profile)
        out["solidify"] = list(self.solidify)
        out["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        return out
