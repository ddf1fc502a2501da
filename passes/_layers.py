"""Layers found by scope: the nodes of a scope, and the one input / one output that make it bypassable.

Shared by the declared-flag pass (bypass the layer) and the group-mask pass (run the layer only when
its router says so). Private to ``layerzero.passes``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from layerzero.errors import LayerZeroError, UnsupportedModelError
from layerzero.passes._graph import const_array, node_subgraphs, same_shape, scope_of
from layerzero.passes._shapes import SymbolicShapes

__all__ = [
    "Layer",
    "bypassable_layer",
    "describe_value",
    "in_scope",
    "initializer_size",
    "layer_hull",
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


def layer_hull(members: list[ir.Node], graph: ir.Graph | None = None) -> list[ir.Node]:
    """``members`` plus every node of ``graph`` computed from a member *and* feeding a member, in graph order.

    Exporters leave nodes without a scope inside a layer: the dynamo exporter's optimizer emits the
    ``Split`` of a fused projection (gate_up, qkv, an expert's gate_up) with no name scope, and the
    TorchScript exporter's ``Shape`` nodes of a layer's reshapes have a bare name. A node that lies
    between two of the layer's nodes is part of the layer's computation whatever its name says; without
    it the layer seems to have an output (into that node) and an input (back from it).
    """
    if not members:
        return []
    graph = graph if graph is not None else members[0].graph
    if graph is None:
        return list(members)
    order = {node: i for i, node in enumerate(graph)}
    owner = _top_level_owners(graph)
    member_set = set(members)
    # Forward: nodes (of ``graph``) reading a member's outputs, transitively.
    after: set[ir.Node] = set()
    stack = [user for node in members for user in _top_users(node, owner)]
    while stack:
        node = stack.pop()
        if node in after or node in member_set or node not in order:
            continue
        after.add(node)
        stack.extend(_top_users(node, owner))
    # Backward: producers of the members' inputs, transitively, kept only where also forward.
    between: set[ir.Node] = set()
    seen: set[ir.Node] = set()
    stack = [p for node in members for p in _producers(node, owner)]
    while stack:
        node = stack.pop()
        if node in seen or node in member_set:
            continue
        seen.add(node)
        if node in after:
            between.add(node)
        stack.extend(_producers(node, owner))
    if not between:
        return list(members)
    return sorted(member_set | between, key=order.__getitem__)


def _top_level_owners(graph: ir.Graph) -> dict[ir.Node, ir.Node]:
    """Each node inside a subgraph of ``graph``'s nodes → the node of ``graph`` that holds it."""
    owner: dict[ir.Node, ir.Node] = {}
    for node in graph:
        for sub in node_subgraphs(node):
            for inner in sub.all_nodes():
                owner[inner] = node
    return owner


def _top_users(node: ir.Node, owner: dict[ir.Node, ir.Node]) -> list[ir.Node]:
    return [owner.get(user, user) for out in node.outputs for user, _ in out.uses()]


def _producers(node: ir.Node, owner: dict[ir.Node, ir.Node]) -> list[ir.Node]:
    """Producers of what ``node`` reads, its subgraphs' outer reads included."""
    inner = [node, *(n for sub in node_subgraphs(node) for n in sub.all_nodes())]
    found = []
    for n in inner:
        for value in n.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and owner.get(producer, producer) is not node:
                found.append(owner.get(producer, producer))
    return found


def bypassable_layer(
    scope: str,
    members: list[ir.Node],
    subject: str,
    error: type[LayerZeroError] = UnsupportedModelError,
    shapes: SymbolicShapes | None = None,
) -> Layer:
    """Check that ``members`` form a layer that can be bypassed; raise ``error`` (``subject`` first) if not.

    ``members`` is first closed over the nodes that lie between two of them (``layer_hull``).
    Exactly one value leaves the layer (read by another node or a graph output), and exactly one
    value entering it (not a constant or initializer) has that value's dtype and shape: the residual
    stream. Other entering values (masks, position tables) are side inputs. Shapes are equal when
    their dims carry the same names or, given ``shapes``, when the operand-based shape rules prove
    them equal (TorchScript exports name almost no intermediate dim).

    Side outputs (FoldZeroFlags' Case 4): when several values leave, exactly one of them matches
    exactly one entering value, and no other leaving value is computed from that entering value,
    the others are side values the layer computes for others (torch.onnx puts shared rotary tables
    and masks into the first layer's scope). ``Layer.members`` then leaves out the nodes that
    compute them: they must keep running whether the layer runs or not.
    """
    members = layer_hull(members)
    graph = members[0].graph if members else None
    owner = _top_level_owners(graph) if graph is not None else {}

    def equal(a: ir.Value, b: ir.Value) -> bool:
        return same_shape(a, b) or (shapes is not None and shapes.same_shape(a, b))

    member_set = set(members)
    produced = {out for node in members for out in node.outputs}
    leaving = [
        out
        for node in members
        for out in node.outputs
        if out.is_graph_output() or any(owner.get(user, user) not in member_set for user, _ in out.uses())
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
        pairs = [(out, v) for out in leaving for v in entering if equal(v, out)]
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
    matching = [v for v in entering if equal(v, out)]
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
