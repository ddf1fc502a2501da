"""Where a pass puts the nodes it makes: the scope rule every pass that inserts nodes goes through.

A value a pass materialises (a shape tensor, a ``ConstantOfShape``, an ``Expand`` of a row, a Pad, a Slice)
lives in the graph (scope) of the node that reads it, placed before that node and after every producer it reads.
ONNX requires both: a graph is topologically sorted, and a subgraph (an ``If`` branch, a ``Loop`` body) sees the
values of its own graph and of the graphs enclosing it, computed before the node that owns it; nothing of an inner
graph is visible outside it. A value that breaks this is no model onnxruntime loads (``Nodes in a graph must be
topologically sorted``; ``not a graph input, initializer, or output of a previous node``), or one whose dead-code
sweep trips on a reader placed before the node it reads.

:class:`Scopes` answers "can ``anchor`` read ``value``?" (:meth:`Scopes.visible`) and inserts new nodes before
their reader (:meth:`Scopes.insert_before`) or after the producer they read (:meth:`Scopes.insert_after`),
checking that every value the new nodes read is visible at that place: a pass that would build a model out of
scope fails there, naming the value, instead of writing a model that does not load. Initializers of the main graph
(``make_constant``) are visible in every scope.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx_ir as ir

from layerzero.errors import CompilerError
from layerzero.passes._graph import node_subgraphs

__all__ = ["Scopes"]


class Scopes:
    """The owner of each subgraph of ``root`` and the order of each graph's nodes, for placing new nodes.

    A graph's order is computed once and again only when a node it lacks is asked about (one inserted since):
    inserting nodes keeps the order of the others, so positions of older nodes stay comparable. The owner map is
    rebuilt when a graph made after it (a new ``If``) is met.
    """

    def __init__(self, root: ir.Graph) -> None:
        self.root = root
        self._owners: dict[int, ir.Node] | None = None
        self._order: dict[int, dict[ir.Node, int]] = {}

    # ---------------------------------------------------------------------------------------------- queries
    def owner(self, graph: ir.Graph) -> ir.Node | None:
        """The node whose attribute holds ``graph`` (None for the main graph or a graph no node holds)."""
        if graph is self.root:
            return None
        if self._owners is None or id(graph) not in self._owners:
            self._owners = {}
            self._index(self.root)
        return self._owners.get(id(graph))

    def _index(self, graph: ir.Graph) -> None:
        assert self._owners is not None
        for node in graph:
            for sub in node_subgraphs(node):
                self._owners[id(sub)] = node
                self._index(sub)

    def chain(self, graph: ir.Graph | None) -> list[ir.Graph]:
        """``graph`` and the graphs enclosing it, innermost first."""
        out: list[ir.Graph] = []
        while graph is not None:
            out.append(graph)
            owner = self.owner(graph)
            graph = owner.graph if owner is not None else None
        return out

    def _position(self, node: ir.Node) -> int:
        graph = node.graph
        assert graph is not None
        order = self._order.get(id(graph))
        if order is None or node not in order:
            order = {n: i for i, n in enumerate(graph)}
            self._order[id(graph)] = order
        return order[node]

    def precedes(self, a: ir.Node, b: ir.Node) -> bool:
        """True when ``a`` comes before ``b`` in their (common) graph."""
        return a.graph is b.graph and self._position(a) < self._position(b)

    def visible(self, value: ir.Value, anchor: ir.Node) -> bool:
        """True when ``anchor`` may read ``value``: an initializer or input of ``anchor``'s graph or of a graph
        enclosing it, or computed before ``anchor`` (before the node owning ``anchor``'s graph, for a value of an
        enclosing graph)."""
        graphs = self.chain(anchor.graph)
        producer = value.producer()
        if producer is None:  # a graph input or an initializer
            return value.graph is not None and any(value.graph is g for g in graphs)
        here = anchor
        for graph in graphs:
            if producer.graph is graph:
                return self.precedes(producer, here)
            owner = self.owner(graph)
            if owner is None:
                return False
            here = owner
        return False

    # ---------------------------------------------------------------------------------------------- insertion
    def _check(self, nodes: Sequence[ir.Node], anchor: ir.Node, also: Iterable[ir.Value] = ()) -> None:
        made: set[ir.Value] = set(also)
        for node in nodes:
            for value in node.inputs:
                if value is not None and value not in made and not self.visible(value, anchor):
                    raise CompilerError(  # a pass would read a value where it is not visible: its bug, not the model's

                        f"new node {node.op_type} {node.name or ''} would read {value.name!r} where it is not "
                        f"visible (placed before {anchor.op_type} {anchor.name or ''})"
                    )
            made.update(node.outputs)

    def insert_before(self, reader: ir.Node, nodes: ir.Node | Sequence[ir.Node]) -> None:
        """Insert ``nodes`` (in order) into ``reader``'s graph right before it."""
        nodes = [nodes] if isinstance(nodes, ir.Node) else list(nodes)
        if not nodes:
            return
        self._check(nodes, reader)
        assert reader.graph is not None
        reader.graph.insert_before(reader, nodes)

    def insert_after(self, producer: ir.Node, nodes: ir.Node | Sequence[ir.Node]) -> None:
        """Insert ``nodes`` (in order) into ``producer``'s graph right after it: they may read its outputs."""
        nodes = [nodes] if isinstance(nodes, ir.Node) else list(nodes)
        if not nodes:
            return
        self._check(nodes, producer, also=producer.outputs)
        assert producer.graph is not None
        producer.graph.insert_after(producer, nodes)
