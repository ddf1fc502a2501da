"""What the router variants share: the ``Router`` they describe, same-type casts, constant fills."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._moe.walk import STD, attr_of, axes_of, const_scalar, sorted_axes

__all__ = [
    "MASK_TYPES",
    "NORMALIZE_EPS",
    "Router",
    "filled",
    "past_same_type_cast",
    "reduces_rows",
    "same_type_cast",
    "through_identity",
    "through_same_type_casts",
]


# ``+ eps`` before a normalisation's division that the skipping form's own ``+ 1e-20`` stands for
# (plugins/reference.py, NORMALIZE_EPS): DeepSeek-V3 / GLM4-MoE / dots1 write exactly 1e-20.
NORMALIZE_EPS = 1e-20


@dataclasses.dataclass
class Router:
    topk: ir.Node
    scores: ir.Node  # Softmax | Sigmoid (of the logits, or of the top-k logits: ``variant``)
    logits: ir.Value  # [T, E]
    values: ir.Value  # the top-k routing weights [T, k] (before any renormalisation Div)
    indices: ir.Value  # TopK indices
    top_k: int
    experts: int
    scoring: str  # "softmax" | "sigmoid"
    variant: str = "scores-topk"  # a key of ROUTER_VARIANTS
    # ``values`` are already the top-k probabilities renormalised to sum 1 (a softmax of the k logits is the
    # softmax over all experts restricted to the top k and renormalised: ``normalize`` 1 of the skipping form).
    normalized: bool = False
    # v2 routing (``biased-select``): the selection bias [E], group limits, the routed scaling factor, and the
    # router's other nodes (selection, gather, normalisation, scaling), removed with the block once dead.
    score_bias: np.ndarray | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)
    routing: str = "topk"  # "sparsemixer": PhiMoE (``topk`` is then the first ArgMax)
    jitter_eps: float = 0.01
    # ``topk-sigmoid`` (Llama 4): the routing matrix [T, E] the router builds itself (the sigmoid of the top-k
    # logits scattered into -inf), which scales each expert's INPUT, not its output.
    matrix: ir.Value | None = None


MASK_TYPES = (ir.DataType.BOOL, ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.INT64, ir.DataType.INT32)


def same_type_cast(node: ir.Node) -> bool:
    """A ``Cast`` to the type its input already has (TorchScript's ``.float()`` of a float32 tensor)."""
    if node.op_type != "Cast" or node.domain not in STD or node.inputs[0] is None:
        return False
    to = attr_of(node, "to")
    return to is not None and node.inputs[0].dtype is not None and ir.DataType(to) == node.inputs[0].dtype


def past_same_type_cast(value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """``value``, or the input of the same-type ``Cast`` producing it (appended to ``nodes``)."""
    producer = value.producer()
    if producer is not None and same_type_cast(producer):
        nodes.append(producer)
        return producer.inputs[0]
    return value


def through_identity(value: ir.Value | None) -> np.ndarray | None:
    """A constant, also behind ``Identity`` (TorchScript shares an equal initializer between layers so)."""
    producer = None if value is None else value.producer()
    while producer is not None and producer.op_type == "Identity" and producer.domain in STD:
        value = producer.inputs[0]
        producer = value.producer()
    return const_array(value)


def filled(value: ir.Value, nodes: list[ir.Node]) -> float | None:
    """The one value a constant-filled tensor holds: a scalar constant, ``ConstantOfShape(value)`` or
    ``Expand(scalar, shape)`` (torch's ``zeros_like`` / ``expand``); None otherwise."""
    scalar = const_scalar(value)
    if scalar is not None:
        return scalar
    node = value.producer()
    if node is None or node.domain not in STD:
        return None
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        found = 0.0 if fill is None else float(fill.value.numpy().reshape(-1)[0])
    elif node.op_type == "Expand":
        found = const_scalar(node.inputs[0])
    else:
        return None
    if found is not None:
        nodes.append(node)
    return found


def through_same_type_casts(value: ir.Value, nodes: list[ir.Node], hops: int = 3) -> ir.Value:
    """Forwards from ``value`` through up to ``hops`` same-type ``Cast``s, each its value's one reader (appended
    to ``nodes``): the value they end in."""
    for _ in range(hops):
        users = [u for u, _ in value.uses()]
        if len(users) != 1 or not same_type_cast(users[0]):
            break
        nodes.append(users[0])
        value = users[0].outputs[0]
    return value


def reduces_rows(node: ir.Node | None, op_type: str, value: ir.Value) -> bool:
    """``node`` is ``op_type(value)`` over the last axis of a ``[T, n]`` value, keeping it (``keepdims=1``)."""
    return (
        node is not None
        and node.op_type == op_type
        and node.inputs[0] is value
        and sorted_axes(axes_of(node), 2) == [1]
        and attr_of(node, "keepdims", 1) == 1
    )
