"""passes/_scope.py: what a node may read (its graph, the graphs enclosing it, before it) and where new nodes go."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from layerzero.errors import CompilerError
from layerzero.passes._scope import Scopes

TEXT = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[N,4] x, bool c) => (float[N,4] y, float[N,4] z) <float one = {1}> {
   a = Relu (x)
   y = If (c) <then_branch: graph = th () => (float[N,4] t2) <float two = {2}> {
                  t1 = Add (a, two)
                  t2 = Mul (t1, one)
               },
               else_branch: graph = el () => (float[N,4] e1) { e1 = Neg (a) }>
   z = Sigmoid (a)
}"""


def _model() -> tuple[ir.Model, dict[str, ir.Node], dict[str, ir.Value]]:
    model = ir.from_proto(onnx.parser.parse_model(TEXT))
    nodes: dict[str, ir.Node] = {}
    values: dict[str, ir.Value] = {}
    for graph in model.graphs():
        values.update({v.name: v for v in graph.inputs})
        values.update(graph.initializers)
        for node in graph:
            for out in node.outputs:
                nodes[out.name] = node
                values[out.name] = out
    return model, nodes, values


def test_visible_follows_the_scopes_and_the_order() -> None:
    model, nodes, values = _model()
    scopes = Scopes(model.graph)
    t1, t2, e1, z, a = nodes["t1"], nodes["t2"], nodes["e1"], nodes["z"], nodes["a"]
    assert scopes.visible(values["x"], t1)  # an input of the main graph, from inside a branch
    assert scopes.visible(values["one"], t2)  # a main-graph initializer
    assert scopes.visible(values["a"], t1)  # computed before the If that owns the branch
    assert scopes.visible(values["t1"], t2)
    assert not scopes.visible(values["t2"], t1)  # after it, in the same branch
    assert not scopes.visible(values["t1"], e1)  # the other branch
    assert not scopes.visible(values["two"], e1)  # the other branch's initializer
    assert not scopes.visible(values["t1"], z)  # inside a branch, read outside
    assert not scopes.visible(values["z"], t1)  # computed after the If
    assert not scopes.visible(values["a"], a)
    assert scopes.visible(values["y"], z)


def test_insert_before_places_nodes_in_the_readers_graph() -> None:
    model, nodes, values = _model()
    scopes = Scopes(model.graph)
    t2 = nodes["t2"]
    shape = ir.node("Shape", [values["a"]])
    scopes.insert_before(t2, shape)
    assert shape.graph is t2.graph and list(t2.graph).index(shape) == list(t2.graph).index(t2) - 1
    after = ir.node("Relu", [values["t2"]])
    scopes.insert_after(t2.graph.node(len(t2.graph) - 1), after)  # may read the producer's own output
    assert after.graph is t2.graph


@pytest.mark.parametrize(
    ("reads", "reader"),
    [("z", "t1"), ("t1", "z"), ("t1", "e1"), ("t2", "t1")],
    ids=["after-the-if", "branch-value-outside", "other-branch", "later-in-the-branch"],
)
def test_a_node_out_of_scope_is_refused(reads: str, reader: str) -> None:
    model, nodes, values = _model()
    scopes = Scopes(model.graph)
    node = ir.node("Identity", [values[reads]])
    with pytest.raises(CompilerError, match=f"would read '{reads}'"):
        scopes.insert_before(nodes[reader], node)
    assert node.graph is None
