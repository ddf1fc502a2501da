"""Where a recorded dynamic path decides, and what it writes, in a compiled graph.

Shared by the force-off variant (``force_off.py``: the profiler measures a path's impact) and by
solidification (``solidify_paths.py``: paths removed for good). The anchors are the contract of
``_dynamic.py``: the mask graph output ``layerzero::mask::<path>`` and, for a MoE block, the router logits
its routing reads. Private to ``layerzero.passes``.
"""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._dynamic import DynamicPath
from layerzero.passes._moe_node import MoENode, is_moe_node

__all__ = ["block_output", "driven_ifs", "graph_output", "moe_logits", "moe_node"]

_STD = ("", "ai.onnx")


def graph_output(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.outputs if v.name == name), None)


def moe_node(graph: ir.Graph, path: str) -> ir.Node | None:
    """The skipping-form node ``ai.layerzero::MoE`` of ``path`` (kept by targets that do not lower it)."""
    for node in graph:
        if is_moe_node(node) and "path" in node.attributes and MoENode.of(node).path == path:
            return node
    return None


def moe_logits(graph: ir.Graph, entry: DynamicPath) -> ir.Value | None:
    """The ``[T, E]`` router logits a MoE path's routing reads, or None when they cannot be found.

    Skipping form: the node's input 1 (a node that computes its router, ``native_router.py``, gets its logits back
    in the graph first: ``unfold_router``). Lowered (``lower_moe.py``, both lowerings): the mask is
    ``Cast(ScatterElements(zeros, TopK(Softmax | Sigmoid(logits)).indices, ...))``, walked back to the logits.
    """
    node = moe_node(graph, entry.path)
    if node is not None:
        view = MoENode.of(node)
        if view.logits is None and view.router_weight is not None:  # the router in the op: put it back in the graph
            from layerzero.passes._graph import NameFactory
            from layerzero.passes.native_router import unfold_router

            return unfold_router(graph, node, NameFactory(graph))
        return view.logits
    value = graph_output(graph, entry.mask_output)
    for _ in range(8):
        producer = value.producer() if value is not None else None
        if producer is None or producer.graph is not graph or producer.domain not in _STD:
            return None
        op = producer.op_type
        if op in ("Cast", "Identity"):
            value = producer.inputs[0]
        elif op == "ScatterElements":
            value = producer.inputs[1]  # the top-k indices
        elif op == "TopK":
            value = producer.inputs[0]  # the scores
        elif op in ("Softmax", "Sigmoid"):
            return producer.inputs[0]
        else:
            return None
    return None


def driven_ifs(graph: ir.Graph, start: ir.Value) -> list[ir.Node]:
    """The ``If`` nodes of ``graph`` whose condition is computed from ``start`` (through nodes of ``graph``,
    not through another ``If``), in graph order."""
    found: set[ir.Node] = set()
    seen: set[ir.Value] = set()
    stack = [start]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for user, index in value.uses():
            if user.graph is not graph:
                continue  # read inside a branch: not a condition of this graph
            if user.op_type == "If" and user.domain in _STD:
                if index == 0:
                    found.add(user)
                continue
            stack.extend(user.outputs)
    return [n for n in graph if n in found]


def block_output(graph: ir.Graph, entry: DynamicPath, logits: ir.Value | None = None) -> ir.Value | None:
    """The value a dynamic path writes: what the rest of the model reads from it.

    MoE: the expert sum (the skipping form's output 0, ``com.microsoft.MoE``'s output, or the last per-expert
    ``If`` of the ``if`` lowering). Gate: the ``If`` that replaced ``x + g * f(x)``. Group: the ``If`` of its
    last layer. None when it cannot be found.
    """
    if entry.kind == "moe":
        node = moe_node(graph, entry.path)
        if node is not None:
            return node.outputs[0]
        logits = logits if logits is not None else moe_logits(graph, entry)
        if logits is None:
            return None
        for user, index in logits.uses():
            if user.domain == "com.microsoft" and user.op_type == "MoE" and index == 1:
                return user.outputs[0]
        ifs = driven_ifs(graph, logits)
    else:
        mask = graph_output(graph, entry.mask_output)
        ifs = driven_ifs(graph, mask) if mask is not None else []
    return ifs[-1].outputs[0] if ifs else None
