"""Layers found by scope: the nodes of a scope, and the one input / one output that make it bypassable.

Shared by the declared-flag pass (bypass the layer) and the group-mask pass (run the layer only when
its router says so). Private to ``layerzero.passes``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from layerzero.errors import LayerZeroError, UnsupportedModelError
from layerzero.passes._graph import const_array, node_subgraphs, same_shape, scope_of

__all__ = [
    "Layer",
    "bypassable_layer",
    "describe_value",
    "in_scope",
    "initializer_size",
    "layer_params",
    "scope_members",
]


@dataclasses.dataclass(frozen=True)
class Layer:
    """A scope's nodes (graph order) with the one value that leaves it and the one that it bypasses to."""

    scope: str
    members: tuple[ir.Node, ...]
    input: ir.Value
    output: ir.Value


def in_scope(scope: str, node_scope: str) -> bool:
    return node_scope == scope or node_scope.startswith(scope + ".")


def scope_members(graph: ir.Graph, scope: str, scopes: dict[ir.Node, str] | None = None) -> list[ir.Node]:
    """The nodes of ``graph`` (not its subgraphs) whose scope is ``scope`` or below it, in graph order."""
    return [n for n in graph if in_scope(scope, scopes[n] if scopes is not None else scope_of(n))]


def bypassable_layer(
    scope: str,
    members: list[ir.Node],
    subject: str,
    error: type[LayerZeroError] = UnsupportedModelError,
) -> Layer:
    """Check that ``members`` form a layer that can be bypassed; raise ``error`` (``subject`` first) if not.

    Exactly one value leaves the members (read by another node or a graph output), and exactly one
    value entering them (not a constant or initializer) has that value's dtype and shape: the residual
    stream. Other entering values (masks, position tables) are side inputs.

    Side outputs (FoldZeroFlags' Case 4): when several values leave, exactly one of them matches
    exactly one entering value, and no other leaving value is computed from that entering value,
    the others are side values the layer computes for others (torch.onnx puts shared rotary tables
    and masks into the first layer's scope). ``Layer.members`` then leaves out the nodes that
    compute them: they must keep running whether the layer runs or not.
    """
    member_set = set(members)
    produced = {out for node in members for out in node.outputs}
    leaving = [
        out
        for node in members
        for out in node.outputs
        if out.is_graph_output() or any(user not in member_set for user, _ in out.uses())
    ]
    entering: list[ir.Value] = []
    for node in members:
        for value in node.inputs:
            if value is None or value in produced or value in entering:
                continue
            if const_array(value) is not None or value.is_initializer():
                continue
            entering.append(value)
    core = members
    if len(leaving) > 1:
        pairs = [(out, v) for out in leaving for v in entering if same_shape(v, out)]
        if len(pairs) == 1:
            out, residual = pairs[0]
            side = [v for v in leaving if v is not out]
            feeding_side = _member_ancestors(side, member_set)
            if not any(residual in n.inputs for n in feeding_side):
                leaving = [out]
                core = [n for n in members if n not in feeding_side]
    if len(leaving) != 1:
        listed = ", ".join(repr(v.name) for v in leaving) or "none"
        raise error(f"{subject} has {len(leaving)} outputs ({listed}); a layer that can be bypassed has exactly one")
    out = leaving[0]
    matching = [v for v in entering if same_shape(v, out)]
    if len(matching) != 1:
        listed = ", ".join(f"{v.name}: {describe_value(v)}" for v in entering) or "none"
        raise error(
            f"{subject} output {out.name!r} is {describe_value(out)}, and "
            f"{len(matching)} of its inputs ({listed}) have that dtype and shape; exactly one must "
            "(the residual stream) for the layer to be bypassed"
        )
    return Layer(scope, tuple(core), matching[0], out)


def _member_ancestors(values: list[ir.Value], members: set[ir.Node]) -> set[ir.Node]:
    """The members that ``values`` are computed from (their producers and those producers' inputs')."""
    found: set[ir.Node] = set()
    stack = [v.producer() for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in found or node not in members:
            continue
        found.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    return found


def layer_params(nodes: list[ir.Node] | tuple[ir.Node, ...]) -> int:
    """Elements of the distinct initializers ``nodes`` (and their subgraphs) read."""
    seen: set[ir.Value] = set()
    total = 0
    for node in nodes:
        inner_nodes = [node, *(n for sub in node_subgraphs(node) for n in sub.all_nodes())]
        for inner in inner_nodes:
            for value in inner.inputs:
                if value is None or value in seen or not value.is_initializer():
                    continue
                seen.add(value)
                total += initializer_size(value)
    return total


def initializer_size(value: ir.Value) -> int:
    """Elements of an initializer's tensor (0 when it has no tensor or no shape)."""
    tensor = value.const_value
    if tensor is None or tensor.shape is None:
        return 0
    size = 1
    for d in tensor.shape.dims:
        size *= int(d)
    return size


def describe_value(value: ir.Value) -> str:
    """``float32[batch,seq,64]``; ``?`` for what is unknown."""
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    shape = "?" if value.shape is None else "[" + ",".join(str(d) for d in value.shape) + "]"
    return f"{dtype}{shape}"
