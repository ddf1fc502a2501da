"""PropagateUniforms: x*0 through symbolic shapes, zero weights, identities, unary ops and shape ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.options import CompileOptions
from layerzero.passes import PropagateUniforms
from layerzero.pipeline import run_static_passes

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'
ZEROS_12 = ", ".join(["0.0"] * 12)


def _producer_op(model: ir.Model, output: str) -> str:
    value = next(v for v in model.graph.outputs if v.name == output)
    return value.producer().op_type


def _output(model: ir.Model, name: str) -> ir.Value:
    return next(v for v in model.graph.outputs if v.name == name)


def _uniform_fill(value: ir.Value) -> float:
    producer = value.producer()
    assert producer.op_type == "ConstantOfShape", producer
    return producer.attributes["value"].value.numpy().item()


# ------------------------------------------------------------------------------------------- Case 1 / 3


@pytest.mark.parametrize("order", ["x * 0", "0 * x"])
def test_mul_by_zero_keeps_the_symbolic_shape(helpers, order):
    # before: y = Mul(x, zeros)                  x: float[N, 4]
    # after:  y = ConstantOfShape(Concat(Shape(x)[0:1], [4]))
    operands = "x, zeros" if order == "x * 0" else "zeros, x"
    text = (
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y) <float[4] zeros = {{0.0, 0.0, 0.0, 0.0}}> {{
            y = Mul({operands})
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=3, dce_delta=2)
    assert check.ops() == {"Shape": 1, "Concat": 1, "ConstantOfShape": 1}
    y = _output(check.model, "y")
    assert _uniform_fill(y) == 0.0
    assert [str(d) for d in y.shape] == ["N", "4"]
    assert "zeros" not in check.model.graph.initializers  # DCE dropped the weight
    for n in (1, 7):  # the shape really is dynamic
        feeds = helpers.random_feeds(check.model, dims={"N": n})
        np.testing.assert_array_equal(helpers.run_ort(check.model, feeds)["y"], np.zeros((n, 4), np.float32))


def test_uniform_graph_output_keeps_its_name(helpers):
    # y is a graph output *and* read by another node: the ConstantOfShape takes the name y.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) <float zero = {0.0}> {
            y = Mul(x, zero)
            z = Add(x, y)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=4,  # Shape, Concat, ConstantOfShape for y; z = Add(x, 0) becomes z = Identity(x)
        dce_delta=2,
    )
    assert [v.name for v in check.model.graph.outputs] == ["y", "z"]
    assert _producer_op(check.model, "y") == "ConstantOfShape"
    assert _producer_op(check.model, "z") == "Identity"


def test_static_uniform_becomes_constant_of_shape_from_an_initializer(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 3] x) => (float[2, 3] y) <float[2, 3] zeros = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0}> {
            p = Mul(x, zeros)
            y = Cos(p)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=1,
        dce_delta=-1,
    )
    assert check.ops() == {"ConstantOfShape": 1}
    assert _uniform_fill(_output(check.model, "y")) == 1.0


@pytest.mark.parametrize(
    ("op", "weight_shape", "out_shape", "extra"),
    [
        ("MatMul", "[4, 3]", "[N, 3]", ""),
        ("Gemm", "[4, 3]", "[2, 3]", ""),
        ("Gemm", "[3, 4]", "[2, 3]", "<transB = 1>"),
    ],
)
def test_contraction_with_an_all_zero_weight_is_zero(helpers, op, weight_shape, out_shape, extra):
    x_shape = "[N, 4]" if op == "MatMul" else "[2, 4]"
    size = 12
    text = (
        HEADER
        + f"""
        g (float{x_shape} x) => (float{out_shape} y)
            <float{weight_shape} w = {{{", ".join(["0.0"] * size)}}}> {{
            y = {op}{extra}(x, w)
        }}
        """
    )
    delta = (3, 2) if op == "MatMul" else (1, 0)  # a static output needs no Shape/Concat
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=delta[0], dce_delta=delta[1])
    assert _uniform_fill(_output(check.model, "y")) == 0.0
    assert op not in check.ops()


def test_gemm_with_zero_weight_and_uniform_bias_is_the_scaled_bias(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 4] x) => (float[2, 3] y)
            <float[4, 3] w = {ZEROS_12}, float[3] b = {0.5, 0.5, 0.5}> {
            y = Gemm<beta = 3.0>(x, w, b)
        }
        """.replace("ZEROS_12", ZEROS_12),
        PropagateUniforms,
        modified=True,
        delta=1,
        dce_delta=0,
    )
    assert _uniform_fill(_output(check.model, "y")) == 1.5


def test_gemm_with_zero_weight_and_non_uniform_bias_is_the_bias_row(helpers):
    # before: y = Gemm(x, 0, b)    after: y = Expand(b, [2, 3])  (a row constant; tests/passes/test_lattice_rows.py)
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 4] x) => (float[2, 3] y)
            <float[4, 3] w = {ZEROS_12}, float[3] b = {1.0, 2.0, 3.0}> {
            y = Gemm(x, w, b)
        }
        """.replace("ZEROS_12", ZEROS_12),
        PropagateUniforms,
        modified=True,
        delta=1,
        dce_delta=0,
    )
    assert check.ops() == {"Expand": 1}


def test_zero_weight_propagates_through_a_chain(helpers):
    # h = x @ 0 (uniform 0) -> Relu(h) = 0 -> x + 0 = x: the whole branch disappears.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                                               0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0}> {
            h = MatMul(x, w)
            r = Relu(h)
            s = Add(x, r)
            y = Sigmoid(s)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=0,
        dce_delta=-3,
    )
    assert check.ops() == {"Sigmoid": 1}
    (sigmoid,) = check.model.graph
    assert sigmoid.inputs[0].name == "x"


# ------------------------------------------------------------------------------------------- Case 2


@pytest.mark.parametrize(
    "expr",
    [
        "Add(x, zeros)",
        "Add(zeros, x)",
        "Sub(x, zeros)",
        "Mul(x, ones)",
        "Mul(ones, x)",
        "Div(x, ones)",
        "Pow(x, ones)",
        "Where(yes, x, ones)",
        "Where(no, ones, x)",
    ],
)
def test_identity_rewrites_bypass_the_op(helpers, expr):
    # before: t = <op>(x, uniform); y = Relu(t)      after: y = Relu(x)
    check = helpers.check_pass(
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y)
            <float[4] zeros = {{0.0, 0.0, 0.0, 0.0}}, float[1] ones = {{1.0}}, bool yes = {{1}}, bool no = {{0}}> {{
            t = {expr}
            y = Relu(t)
        }}
        """,
        PropagateUniforms,
        modified=True,
        delta=0,
        dce_delta=-1,
    )
    assert check.ops() == {"Relu": 1}
    assert next(iter(check.model.graph)).inputs[0].name == "x"


def test_bypass_of_a_graph_output_keeps_its_name(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float zero = {0.0}> {
            e = Exp(x)
            y = Add(e, zero)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=0,
        dce_delta=-1,
    )
    assert check.ops() == {"Exp": 1}
    assert _producer_op(check.model, "y") == "Exp"


def test_logical_identities(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (bool[N, 4] a) => (bool[N, 4] y, bool[N, 4] z) <bool t = {1}, bool f = {0}> {
            p = And(a, t)
            q = Or(f, p)
            y = Not(q)
            r = And(a, f)
            z = Or(r, a)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=1,  # z = Or(And(a, false), a) is a graph input under another name: Identity(a)
        dce_delta=-3,
    )
    assert check.ops() == {"Not": 1, "Identity": 1}


# ------------------------------------------------------------------------------------------- unary ops


@pytest.mark.parametrize(
    ("op", "fill"),
    [("Cos", 1.0), ("Sin", 0.0), ("Exp", 1.0), ("Neg", -2.0), ("Sigmoid", 0.5), ("Sqrt", np.sqrt(2.0))],
)
def test_unary_op_of_a_uniform_is_uniform(helpers, op, fill):
    # before: z = x * 0 + c; y = Op(z)      after: y = ConstantOfShape(shape of x, Op(c))
    c = 0.0 if op in ("Cos", "Sin", "Exp", "Sigmoid") else 2.0
    check = helpers.check_pass(
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y) <float zero = {{0.0}}, float c = {{{c}}}> {{
            m = Mul(x, zero)
            z = Add(m, c)
            y = {op}(z)
        }}
        """,
        PropagateUniforms,
        modified=True,
        delta=3,
        dce_delta=0,
    )
    assert check.ops() == {"Shape": 1, "Concat": 1, "ConstantOfShape": 1}
    np.testing.assert_allclose(_uniform_fill(_output(check.model, "y")), fill, rtol=1e-6)


def test_cast_of_a_uniform_changes_its_dtype(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (int64[N, 4] y, float16[N, 4] h) <float zero = {0.0}, float c = {2.7}> {
            m = Mul(x, zero)
            z = Add(m, c)
            y = Cast<to = 7>(z)
            h = Cast<to = 10>(z)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=4,  # Shape and Concat are shared by both ConstantOfShape
        dce_delta=0,
    )
    y, h = _output(check.model, "y"), _output(check.model, "h")
    assert _uniform_fill(y) == 2
    assert y.producer().attributes["value"].value.dtype == ir.DataType.INT64
    assert h.producer().attributes["value"].value.dtype == ir.DataType.FLOAT16


# ------------------------------------------------------------------------------------------- shape ops


def test_shape_ops_of_a_uniform_are_uniform(helpers):
    # Every shape op keeps the uniform value; only the last one, a graph output, is materialised.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 3, 2] y) <float zero = {0.0}, int64[1] axes = {1}, int64[1] starts = {1},
                                                   int64[1] ends = {4}, int64[3] shape3 = {0, 3, 2},
                                                   int64[3] big = {3, 2, 1}> {
            z = Mul(x, zero)
            c = Concat<axis = 1>(z, z)
            s = Slice(c, starts, ends, axes)
            t = Transpose<perm = [1, 0]>(s)
            u = Unsqueeze(t, axes)
            e = Expand(u, big)
            v = Transpose<perm = [2, 1, 0]>(e)
            y = Reshape(v, shape3)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=3,
        dce_delta=-5,
    )
    assert check.ops() == {"Shape": 1, "Concat": 1, "ConstantOfShape": 1}
    assert _uniform_fill(_output(check.model, "y")) == 0.0


def test_concat_of_different_uniforms_is_not_uniform(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 8] y) <float zero = {0.0}, float one = {1.0}> {
            z = Mul(x, zero)
            o = Add(z, one)
            y = Concat<axis = 1>(z, o)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=4,  # z and o each become ConstantOfShape (one Shape/Concat shared); y stays a Concat
        dce_delta=2,
    )
    assert _producer_op(check.model, "y") == "Concat"


def test_where_on_a_uniform_condition(helpers):
    # The condition is computed: Greater(x * 0, 0.5) is uniform false, so Where picks its else input.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float zero = {0.0}, float half = {0.5}> {
            m = Mul(x, zero)
            keep = Greater(m, half)
            s = Sin(x)
            w = Where(keep, s, x)
            y = Neg(w)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=0,
        dce_delta=-4,
    )
    assert check.ops() == {"Neg": 1}


# ------------------------------------------------------------------------------------------- assume_finite


def test_assume_finite_off_keeps_x_times_zero(helpers):
    text = (
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float[4] zeros = {0.0, 0.0, 0.0, 0.0}> {
            m = Mul(x, zeros)
            y = Add(m, x)
        }
        """
    )
    check = helpers.check_pass(text, lambda: PropagateUniforms(assume_finite=False), modified=False, delta=0)
    feeds = {"x": np.array([[np.nan, 1.0, np.inf, -2.0]], np.float32)}
    y = helpers.run_ort(check.model, feeds)["y"]
    assert np.isnan(y[0, 0]) and np.isnan(y[0, 2])  # NaN * 0 and Inf * 0 are NaN
    # The pipeline honours the option too.
    model = helpers.parse(text)
    run_static_passes(model, CompileOptions(assume_finite=False))
    assert helpers.count_nodes(model, "Mul") == 1
    np.testing.assert_array_equal(helpers.run_ort(model, feeds)["y"], y)
    # And with assume_finite (the default) the Mul is folded: finite inputs only.
    model = helpers.parse(text)
    run_static_passes(model, CompileOptions())
    assert helpers.count_nodes(model, "Mul") == 0


def test_assume_finite_off_still_folds_finite_facts(helpers):
    # Cos(0) = 1 and x * 1 = x hold for every x: they fold even without assume_finite.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float zero = {0.0}> {
            c = Cos(zero)
            m = Mul(x, c)
            y = Neg(m)
        }
        """,
        lambda: PropagateUniforms(assume_finite=False),
        modified=True,
        delta=0,
        dce_delta=-2,
    )
    assert check.ops() == {"Neg": 1}


# ------------------------------------------------------------------------------------------- negatives


@pytest.mark.parametrize(
    "body",
    [
        "t = Mul(x, two)",  # x * 2 is not x
        "t = Add(x, ramp)",  # a constant, but not uniform
        "t = Add(x, zeros34)",  # broadcast: [4] + [3, 4] is [3, 4], not x
        "t = Where(yes34, x, one)",  # broadcast through Where
        "t = Sub(zeros, x)",  # 0 - x is -x
        "t = Div(ones, x)",  # 1 / x
    ],
)
def test_non_identities_are_left_alone(helpers, body):
    helpers.check_pass(
        HEADER
        + f"""
        g (float[4] x) => (float[] y)
            <float two = {{2.0}}, float[4] ramp = {{0.0, 1.0, 2.0, 3.0}}, float[4] zeros = {{0.0, 0.0, 0.0, 0.0}},
             float[3, 4] zeros34 = {{0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0}},
             bool[3, 4] yes34 = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}}, float one = {{1.0}}, float[1] ones = {{1.0}}> {{
            {body}
            y = Relu(t)
        }}
        """,
        PropagateUniforms,
        modified=False,
        delta=0,
    )


def test_unknown_symbolic_dim_is_not_materialised(helpers):
    # The uniform's shape has a dim no graph input carries: it cannot be rebuilt, so nothing changes.
    helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[K] y) <float zero = {0.0}, int64[1] flat = {-1}> {
            m = Mul(x, zero)
            y = Reshape(m, flat)
        }
        """,
        PropagateUniforms,
        modified=True,  # m itself is still materialised from x's shape
        delta=3,
        dce_delta=2,
    )


def test_uniforms_inside_an_if_branch(helpers):
    # Subgraphs are visited: the branch's x * 0 becomes a ConstantOfShape built from the outer x.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x, bool b) => (float[N, 4] y) <float zero = {0.0}> {
            y = If(b) <then_branch = then_g () => (float[N, 4] t) {
                    m = Mul(x, zero)
                    t = Exp(m)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Neg(x)
                }>
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=3,
        dce_delta=1,
    )
    then_branch = next(iter(check.model.graph)).attributes["then_branch"].value
    assert _uniform_fill(then_branch.outputs[0]) == 1.0
    for flag in (True, False):
        feeds = helpers.random_feeds(check.model)
        feeds["b"] = np.array(flag)
        expected = np.ones((3, 4), np.float32) if flag else -feeds["x"]
        np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], expected, rtol=1e-6)


def test_string_uniform_is_not_materialised(helpers):
    # ConstantOfShape cannot fill strings: a uniform string tensor is left as it is computed.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (string[N, 4] y) <string[1] s = {"a"}> {
            shape = Shape(x)
            e = Expand(s, shape)
            y = Identity(e)
        }
        """,
        PropagateUniforms,
        modified=False,
        delta=0,
    )
    assert check.ops() == {"Shape": 1, "Expand": 1, "Identity": 1}
