"""Helpers for dynamic passes over the graph contract (``layerzero.contract``): read and record the model's
dynamic paths, create the run-time threshold input. The names themselves live in ``layerzero.contract``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from layerzero.contract import (
    DYNAMIC_META_KEY,
    MASK_PREFIX,
    MOE_DOMAIN,
    MOE_OP,
    ROUTER_PREFIX,
    THRESHOLD_INPUT,
    DynamicPath,
)
from layerzero.passes._builder import claim_name

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
    claim_name(graph, THRESHOLD_INPUT)  # a value of the model called so is renamed (issue 20)
    value = ir.Value(
        name=THRESHOLD_INPUT,
        type=ir.TensorType(ir.DataType.FLOAT),
        shape=ir.Shape([]),
        const_value=ir.tensor(np.array(default, np.float32), name=THRESHOLD_INPUT),
    )
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value
