"""The contract between dynamic passes, the compiler and the runtime.

A dynamic pass (MoE expert skipping, gated branches, group masks) makes its skip decision a graph
output named ``layerzero::mask::<path>`` (DESIGN.md: one mechanism, no side channel) and records
one ``DynamicPath`` in the model's metadata under ``layerzero.dynamic`` (a JSON list). The
compiler copies that list into the bundle manifest's ``dynamic`` section; the runtime reads it to
turn masks into the per-request report.

Mask layout: shape ``[..., len(subpaths)]`` (e.g. ``[T, E]`` for a MoE block: token × expert), or
``[...]`` when there is one subpath (a gate: ``[T]`` per token or ``[]`` scalar; a group: ``[]``).
True / nonzero = that subpath RUNS for that token. A router output ``layerzero::router::<path>``
(optional), shape ``[T]``, holds each token's top-1 routing probability (routing_confidence).

Run-time threshold: a lowering that compares against ``zeroing_threshold`` reads it from the graph
input ``layerzero::threshold`` (float32 scalar) whose initializer holds the compiled default, so the
runtime (the guard's auto-raise) can change it per request without recompiling.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx_ir as ir

__all__ = [
    "DYNAMIC_META_KEY",
    "MASK_PREFIX",
    "MOE_DOMAIN",
    "MOE_OP",
    "ROUTER_PREFIX",
    "THRESHOLD_INPUT",
    "DynamicPath",
    "read_dynamic_paths",
    "record_dynamic_path",
    "threshold_input",
]

MASK_PREFIX = "layerzero::mask::"
ROUTER_PREFIX = "layerzero::router::"
DYNAMIC_META_KEY = "layerzero.dynamic"
THRESHOLD_INPUT = "layerzero::threshold"
#: The MoE pass's target-independent skipping form ``ai.layerzero::MoE``, which the lowerings replace.
MOE_DOMAIN = "ai.layerzero"
MOE_OP = "MoE"


@dataclasses.dataclass(frozen=True)
class DynamicPath:
    path: str  # e.g. "model.layers.0.mlp"
    kind: str  # "moe" | "gate" | "group"
    subpaths: tuple[str, ...]  # e.g. ("model.layers.0.mlp.experts.0", ...), one per mask's last axis
    params: tuple[int, ...]  # parameters each subpath touches when it runs
    mask_output: str
    router_output: str | None = None
    detail: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["subpaths"] = list(self.subpaths)
        out["params"] = list(self.params)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> DynamicPath:
        return cls(
            path=d["path"],
            kind=d["kind"],
            subpaths=tuple(d["subpaths"]),
            params=tuple(int(p) for p in d["params"]),
            mask_output=d["mask_output"],
            router_output=d.get("router_output"),
            detail=dict(d.get("detail") or {}),
        )


def read_dynamic_paths(model: ir.Model) -> list[DynamicPath]:
    raw = model.metadata_props.get(DYNAMIC_META_KEY)
    return [] if not raw else [DynamicPath.from_dict(d) for d in json.loads(raw)]


def record_dynamic_path(model: ir.Model, entry: DynamicPath) -> None:
    """Append ``entry`` (replacing one with the same path) to the model's dynamic-path list."""
    entries = [e for e in read_dynamic_paths(model) if e.path != entry.path]
    entries.append(entry)
    model.metadata_props[DYNAMIC_META_KEY] = json.dumps([e.to_dict() for e in entries])


def threshold_input(model: ir.Model, default: float) -> ir.Value:
    """The run-time threshold ``layerzero::threshold``: a float32 scalar graph input initialised to
    ``default``; created by the first dynamic pass that needs it, shared by the others."""
    graph = model.graph
    for value in graph.inputs:
        if value.name == THRESHOLD_INPUT:
            return value
    value = ir.Value(
        name=THRESHOLD_INPUT,
        type=ir.TensorType(ir.DataType.FLOAT),
        shape=ir.Shape([]),
        const_value=ir.tensor(np.array(default, np.float32), name=THRESHOLD_INPUT),
    )
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value
