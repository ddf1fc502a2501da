"""RemoveDeadCode: dead chains, unused initializers, graph-input initializers, dead subgraph owners."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes import RemoveDeadCode

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def test_dead_chain_goes_in_one_run(helpers):
    # before: a = Sin(x); b = Cos(a); c = Exp(b) (unused); y = Neg(x)     after: y = Neg(x)
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) {
            a = Sin(x)
            b = Cos(a)
            c = Exp(b)
            y = Neg(x)
        }
        """,
        RemoveDeadCode,
        modified=True,
        delta=-3,
    )
    assert check.ops() == {"Neg": 1}


def test_nothing_dead_is_not_modified(helpers):
    helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
            a = Sin(x)
            y = Mul(a, w)
            z = Cos(a)
        }
        """,
        RemoveDeadCode,
        modified=False,
        delta=0,
    )


def test_node_with_one_used_output_stays(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 2] y) {
            a, b = Split<num_outputs = 2, axis = 1>(x)
            y = Neg(b)
        }
        """,
        RemoveDeadCode,
        modified=False,
        delta=0,
    )
    assert check.ops() == {"Split": 1, "Neg": 1}


def test_unused_initializer_is_removed(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y)
            <float[4] w = {1.0, 2.0, 3.0, 4.0}, float[4] unused = {0.0, 0.0, 0.0, 0.0}> {
            y = Mul(x, w)
        }
        """,
        RemoveDeadCode,
        modified=True,  # no node removed: dropping the initializer alone is a change
        delta=0,
    )
    assert set(check.model.graph.initializers) == {"w"}


def test_initializer_read_only_by_a_dead_node_goes_with_it(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
            d = Mul(x, w)
            y = Neg(x)
        }
        """,
        RemoveDeadCode,
        modified=True,
        delta=-1,
    )
    assert set(check.model.graph.initializers) == set()


def test_graph_input_initializer_is_kept(helpers):
    # `bias` is a graph input with a default: users may feed it, so it stays even when unused.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x, float[4] bias) => (float[N, 4] y) <float[4] bias = {1.0, 2.0, 3.0, 4.0}> {
            y = Neg(x)
        }
        """,
        RemoveDeadCode,
        modified=False,
        delta=0,
    )
    assert "bias" in check.model.graph.initializers
    assert [v.name for v in check.model.graph.inputs] == ["x", "bias"]


def test_initializer_that_is_a_graph_output_is_kept(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y, float[4] w) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
            y = Neg(x)
        }
        """,
        RemoveDeadCode,
        modified=False,
        delta=0,
    )
    assert "w" in check.model.graph.initializers


DEAD_IF = (
    HEADER
    + """
    g (float[N, 4] x, bool b) => (float[N, 4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
        s = Sin(x)
        d = If(b) <then_branch = then_g () => (float[N, 4] t) {
                t = Mul(s, w)
            }, else_branch = else_g () => (float[N, 4] e) {
                e = Neg(s)
            }>
        y = Neg(x)
    }
    """
)


def test_dead_if_releases_the_outer_values_its_branches_read(helpers):
    # The If is dead; its branches are the only readers of s (and w): Sin and w die on the same run.
    check = helpers.check_pass(DEAD_IF, RemoveDeadCode, modified=True, delta=-4)
    assert check.ops() == {"Neg": 1}
    assert set(check.model.graph.initializers) == set()
    (neg,) = check.model.graph
    assert neg.inputs[0].name == "x"


def _sin_then_if(then_body: str) -> str:
    """s = Sin(x) outside an If on b whose then branch is ``then_body`` (giving t) and whose else is Neg(x)."""
    return (
        HEADER
        + f"""
        g (float[N, 4] x, bool b) => (float[N, 4] y) {{
            s = Sin(x)
            y = If(b) <then_branch = then_g () => (float[N, 4] t) {{
                    {then_body}
                }}, else_branch = else_g () => (float[N, 4] e) {{
                    e = Neg(x)
                }}>
        }}
        """
    )


def test_dead_node_inside_a_live_branch(helpers):
    check = helpers.check_pass(_sin_then_if("unused = Exp(s)\n t = Cos(s)"), RemoveDeadCode, modified=True, delta=-1)
    assert check.ops() == {"Sin": 1, "If": 1, "Cos": 1, "Neg": 1}
    for flag in (True, False):
        feeds = helpers.random_feeds(check.model)
        feeds["b"] = np.array(flag)
        expected = np.cos(np.sin(feeds["x"])) if flag else -feeds["x"]
        np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], expected, rtol=1e-6, atol=1e-6)


def test_outer_value_read_by_a_live_branch_stays(helpers):
    check = helpers.check_pass(_sin_then_if("t = Cos(s)"), RemoveDeadCode, modified=False, delta=0)
    assert check.ops()["Sin"] == 1


def test_outer_value_read_only_by_a_dead_node_in_a_live_branch(helpers):
    # The branch's dead Exp is the only reader of s: both go on one run (subgraphs are swept first).
    check = helpers.check_pass(_sin_then_if("unused = Exp(s)\n t = Cos(x)"), RemoveDeadCode, modified=True, delta=-2)
    assert check.ops() == {"If": 1, "Cos": 1, "Neg": 1}


def test_if_dead_through_a_dead_consumer_releases_its_reads_on_the_same_run(helpers):
    # The If is dead only because its one reader (Exp) is: onnx-ir's walk alone would leave Sin and w behind.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x, bool b) => (float[N, 4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
            s = Sin(x)
            d = If(b) <then_branch = then_g () => (float[N, 4] t) {
                    t = Mul(s, w)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Neg(s)
                }>
            c = Exp(d)
            y = Neg(x)
        }
        """,
        RemoveDeadCode,
        modified=True,
        delta=-5,
    )
    assert check.ops() == {"Neg": 1}
    assert set(check.model.graph.initializers) == set()


def test_unused_initializer_of_a_subgraph_is_removed(helpers):
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 4] x, bool b) => (float[N, 4] y) {
            y = If(b) <then_branch = then_g () => (float[N, 4] t) {
                    t = Cos(x)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Neg(x)
                }>
        }
        """
    )
    (if_node,) = model.graph
    branch = if_node.attributes["then_branch"].as_graph()
    branch.initializers.add(ir.Value(name="unused_w", const_value=ir.tensor(np.ones(4, np.float32), name="unused_w")))
    assert RemoveDeadCode()(model).modified
    assert not branch.initializers
    assert not RemoveDeadCode()(model).modified
