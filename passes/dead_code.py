"""Dead-code and unused-initializer removal: onnx-ir's ``RemoveUnusedNodesPass`` plus what it lacks."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from layerzero.passes._graph import node_subgraphs, release_subgraphs

__all__ = ["RemoveDeadCode"]


class RemoveDeadCode(RemoveUnusedNodesPass):
    """Remove nodes none of whose outputs is used, then initializers nothing reads.

    Cases (1, 2: onnx-ir's pass; 3, 4: added here):
    1. A node whose outputs are neither consumed nor graph outputs is removed, walking each graph from its outputs
       back, so one call removes whole chains; the subgraphs of live nodes are swept when the walk reaches their
       owner, so an outer value read only by a dead node of a live branch dies on the same walk. (onnx-ir also
       trims trailing empty inputs and unused optional outputs of standard ops.)
    2. A main-graph initializer that no node reads, and that is neither a graph input nor a graph output, goes.
    3. A dead node that owns subgraphs (an ``If`` nothing reads) releases the outer values its subgraphs read
       before the walk: onnx-ir removes the node but its subgraph nodes keep their uses, so the producers of
       those values (and the initializers) would survive until the next call.
    4. An unused initializer of a subgraph goes too.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        live: set[ir.Node] = set()
        _mark_live(model.graph, live)
        for graph in model.graphs():
            for node in graph:
                if node not in live and node_subgraphs(node):
                    release_subgraphs(node)  # Case 3: its outputs are dead, so the walk below removes it
        result = super().call(model)
        modified = result.modified
        for graph in model.graphs():
            if graph is model.graph:
                continue
            inputs, outputs = set(graph.inputs), set(graph.outputs)
            dead = [n for n, v in graph.initializers.items() if not v.uses() and v not in inputs and v not in outputs]
            for name in dead:  # Case 4
                graph.initializers.pop(name)
            modified |= bool(dead)
        return ir.passes.PassResult(model, modified=modified)


def _mark_live(graph: ir.Graph, live: set[ir.Node]) -> None:
    """Add to ``live`` the nodes of ``graph`` (and of the subgraphs of live nodes) the graph's outputs need.

    Consumers before producers: a node is live when it makes a graph output or a live node reads one of its
    outputs; the subgraphs of a live node are marked before the outer nodes above it, whose values they read.
    """
    outputs = set(graph.outputs)
    for node in reversed(list(graph)):
        if any(out in outputs or any(user in live for user, _ in out.uses()) for out in node.outputs):
            live.add(node)
            for sub in node_subgraphs(node):
                _mark_live(sub, live)
