"""Dead-code and unused-initializer removal."""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._graph import iter_graphs, release_subgraphs

__all__ = ["RemoveDeadCode"]

# Nodes with an effect beyond their outputs are never removed.
_SIDE_EFFECTS = frozenset({"Print"})


def _used(value: ir.Value) -> bool:
    return bool(value.uses()) or value.is_graph_output()


class RemoveDeadCode(ir.passes.InPlacePass):
    """Remove nodes none of whose outputs is used, then initializers nothing reads.

    Cases:
    1. A node whose outputs are neither consumed nor graph outputs is removed; its inputs may become
       dead in turn (the graph is walked from the outputs back, so one call removes whole chains).
    2. An initializer that no node reads, is not a graph input and not a graph output is removed.
    Subgraphs are visited, before the graph that owns them; a node used only inside a removed
    subgraph (or only by dead nodes of a live one) dies with it on the same walk, since removing the
    subgraph's owner releases its uses.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        # Subgraphs before the graphs that own them, each in reverse order: consumers go before
        # producers, so an outer value read only by a dead node of a live branch dies on this run too.
        for graph in reversed(list(iter_graphs(model.graph))):
            modified |= self._remove_dead_nodes(graph)
        for graph in list(iter_graphs(model.graph)):
            modified |= self._remove_unused_initializers(graph)
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _remove_dead_nodes(graph: ir.Graph) -> bool:
        modified = False
        for node in reversed(list(graph)):
            if node.op_type in _SIDE_EFFECTS and node.domain in ("", "ai.onnx"):
                continue
            if any(_used(out) for out in node.outputs):
                continue
            # Case 1: removing a node detaches its inputs, so earlier producers see the new use counts.
            release_subgraphs(node)
            graph.remove(node, safe=True)
            modified = True
        return modified

    @staticmethod
    def _remove_unused_initializers(graph: ir.Graph) -> bool:
        graph_inputs = set(graph.inputs)
        dead = [name for name, value in graph.initializers.items() if value not in graph_inputs and not _used(value)]
        for name in dead:  # Case 2
            graph.initializers.pop(name)
        return bool(dead)
