"""Row constants (a constant tensor broadcast over the token axes) and shapes proved from operands."""

from __future__ import annotations

import numpy as np
import pytest

from layerzero.passes import PropagateUniforms

HEADER = '<ir_version: 10, opset_import: ["" : 20]>'


def _floats(values) -> str:
    return ", ".join(f"{float(v)!r}" for v in np.asarray(values).reshape(-1))


W_DOWN = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 - 0.5
B_UP = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
B_DOWN = np.array([0.1, 0.2, -0.3], np.float32)


@pytest.mark.parametrize("activation", ["Gelu", "Relu", "Tanh", "Sigmoid"])
def test_mlp_with_a_zero_up_projection_and_a_bias_is_one_added_row(helpers, activation):
    # before: y = x + (act(x @ 0 + b_up) @ W_down + b_down)     x: float[N, 3]
    # after:  y = Add(x, R)  with R = act(b_up) @ W_down + b_down an initializer
    text = (
        HEADER
        + f"""
        g (float[N, 3] x) => (float[N, 3] y)
            <float[3, 4] w_up = {{{_floats(np.zeros(12))}}}, float[4] b_up = {{{_floats(B_UP)}}},
             float[4, 3] w_down = {{{_floats(W_DOWN)}}}, float[3] b_down = {{{_floats(B_DOWN)}}}> {{
            h = MatMul(x, w_up)
            hb = Add(h, b_up)
            a = {activation}(hb)
            d = MatMul(a, w_down)
            db = Add(d, b_down)
            y = Add(x, db)
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=0, dce_delta=-5)
    assert check.ops() == {"Add": 1}
    for n in (1, 6):
        feeds = helpers.random_feeds(check.model, dims={"N": n})
        got = helpers.run_ort(check.model, feeds)["y"]
        act = {"Relu": lambda v: np.maximum(v, 0), "Tanh": np.tanh, "Sigmoid": lambda v: 1 / (1 + np.exp(-v))}
        if activation == "Gelu":
            from math import erf

            row_in = np.array([0.5 * v * (1 + erf(v / np.sqrt(2))) for v in B_UP], np.float32)
        else:
            row_in = act[activation](B_UP)
        np.testing.assert_allclose(got, feeds["x"] + row_in @ W_DOWN + B_DOWN, rtol=1e-5, atol=1e-5)


def test_gemm_mlp_with_zero_weights_folds_through_reshapes(helpers):
    # GPT-2's Conv1D as the TorchScript exporter writes it: Reshape to 2-D, Gemm, Reshape back.
    text = (
        HEADER
        + f"""
        g (float[B, S, 3] x) => (float[B, S, 3] y)
            <float[3, 4] w_up = {{{_floats(np.zeros(12))}}}, float[4] b_up = {{{_floats(B_UP)}}},
             float[4, 3] w_down = {{{_floats(W_DOWN)}}}, float[3] b_down = {{{_floats(B_DOWN)}}},
             int64[2] flat = {{-1, 3}}> {{
            shape = Shape(x)
            lead = Slice(shape, zero1, two1)
            x2 = Reshape(x, flat)
            h2 = Gemm(x2, w_up, b_up)
            up_shape = Concat<axis = 0>(lead, four1)
            h = Reshape(h2, up_shape)
            a = Tanh(h)
            a2 = Reshape(a, flat4)
            d2 = Gemm(a2, w_down, b_down)
            d = Reshape(d2, shape)
            y = Add(x, d)
        }}
        """.replace(
            "<float[3, 4] w_up",
            "<int64[1] zero1 = {0}, int64[1] two1 = {2}, int64[1] four1 = {4}, int64[2] flat4 = {-1, 4},"
            " float[3, 4] w_up",
        )
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=0, dce_delta=-10)
    assert check.ops() == {"Add": 1}
    feeds = helpers.random_feeds(check.model, dims={"B": 2, "S": 5})
    expected = feeds["x"] + np.tanh(B_UP) @ W_DOWN + B_DOWN
    np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], expected, rtol=1e-5, atol=1e-5)


def test_row_graph_output_is_expanded_to_the_operand_shape(helpers):
    # before: y = LayerNormalization(x @ 0 + b)   after: y = Expand(R, Shape(x)[0:1] ++ [4])
    text = (
        HEADER
        + f"""
        g (float[N, 3] x) => (float[N, 4] y)
            <float[3, 4] w = {{{_floats(np.zeros(12))}}}, float[4] b = {{{_floats(B_UP)}}},
             float[4] scale = {{1.0, 2.0, 0.5, 1.0}}, float[4] shift = {{0.0, 0.1, 0.2, 0.3}}> {{
            h = MatMul(x, w)
            hb = Add(h, b)
            y = LayerNormalization<axis = -1>(hb, scale, shift)
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=3, dce_delta=0)
    assert check.ops() == {"Shape": 1, "Concat": 1, "Expand": 1}
    centred = B_UP - B_UP.mean()
    row = centred / np.sqrt((centred**2).mean() + 1e-5) * [1.0, 2.0, 0.5, 1.0] + [0.0, 0.1, 0.2, 0.3]
    for n in (1, 4):
        feeds = helpers.random_feeds(check.model, dims={"N": n})
        got = helpers.run_ort(check.model, feeds)["y"]
        np.testing.assert_allclose(got, np.broadcast_to(row, (n, 4)), rtol=1e-5, atol=1e-5)


def test_row_read_by_a_non_broadcasting_op_is_kept_exact(helpers):
    # The row feeds a MatMul with a run-time weight: it is materialised with Expand, the MatMul stays.
    text = (
        HEADER
        + f"""
        g (float[N, 3] x, float[4, 2] v) => (float[N, 2] y)
            <float[3, 4] w = {{{_floats(np.zeros(12))}}}, float[4] b = {{{_floats(B_UP)}}}> {{
            h = MatMul(x, w)
            hb = Add(h, b)
            y = MatMul(hb, v)
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=3, dce_delta=1)
    assert check.ops() == {"Shape": 1, "Concat": 1, "Expand": 1, "MatMul": 1}


def test_x_times_one_with_unnamed_dims_is_bypassed_by_operand_shapes(helpers):
    # The TorchScript exporter's rotary: cos = Cos(pos * 0) has dims shape inference cannot name, but
    # they come from the same Shape(x) as x's: q * cos is q, q * sin is 0, q + 0 is q.
    text = (
        HEADER
        + """
        g (float[B, S, 4] q) => (float[B, S, 4] y) <float[4] zero = {0.0, 0.0, 0.0, 0.0},
                                                     int64[1] one = {1}, int64 start = 0, int64 step = 1> {
            shape = Shape(q)
            s = Gather<axis = 0>(shape, one_scalar)
            r = Range(start, s, step)
            rf = Cast<to = 1>(r)
            pos = Unsqueeze(rf, one)
            freqs = Mul(pos, zero)
            cos = Cos(freqs)
            sin = Sin(freqs)
            a = Mul(q, cos)
            neg = Neg(q)
            b = Mul(neg, sin)
            y = Add(a, b)
        }
        """.replace("int64 start = 0", "int64 one_scalar = {1}, int64 start = {0}").replace(
            "int64 step = 1", "int64 step = {1}"
        )
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=1, dce_delta=-11)
    assert check.ops() == {"Identity": 1}
    for s in (1, 7):
        feeds = helpers.random_feeds(check.model, dims={"B": 2, "S": s})
        np.testing.assert_array_equal(helpers.run_ort(check.model, feeds)["y"], feeds["q"])


def test_a_row_that_broadcasting_would_widen_is_not_read_as_an_initializer(helpers):
    # x: [N, 1]; the row has width 4: Add(x, R) would be [N, 4] = the same, so it may be read directly;
    # but Add(x, row) where x is [N, 4] and the row value is [N, 4] is the safe case. Here the output of
    # the consumer is [N, 4] either way: the rewrite must keep the values.
    text = (
        HEADER
        + f"""
        g (float[N, 1] x, float[N, 3] z) => (float[N, 4] y)
            <float[3, 4] w = {{{_floats(np.zeros(12))}}}, float[4] b = {{{_floats(B_UP)}}}> {{
            h = MatMul(z, w)
            hb = Add(h, b)
            y = Add(x, hb)
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=0, dce_delta=-2)
    feeds = helpers.random_feeds(check.model, dims={"N": 3})
    np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], feeds["x"] + B_UP, rtol=1e-6)


def test_gather_from_a_table_of_equal_rows_then_split_is_two_uniforms(helpers):
    # GPT-J's cached [positions, sin | cos] table with zero frequencies: every row is [0, 0, 1, 1].
    # before: sin, cos = Split(Gather(table, pos)); y = q * cos + q * sin     after: y = q
    table = np.tile(np.array([0.0, 0.0, 1.0, 1.0], np.float32), (8, 1))
    text = (
        HEADER
        + f"""
        g (float[B, S, 2] q, int64[B, S] pos) => (float[B, S, 2] y)
            <float[8, 4] table = {{{_floats(table)}}}, int64[2] halves = {{2, 2}}> {{
            sincos = Gather<axis = 0>(table, pos)
            sin, cos = Split<axis = -1>(sincos, halves)
            a = Mul(q, cos)
            b = Mul(q, sin)
            y = Add(a, b)
        }}
        """
    )
    check = helpers.check_pass(text, PropagateUniforms, modified=True, delta=1, dce_delta=-4)
    assert check.ops() == {"Identity": 1}
    feeds = helpers.random_feeds(check.model, dims={"B": 2, "S": 3})
    np.testing.assert_array_equal(helpers.run_ort(check.model, feeds)["y"], feeds["q"])


def test_gather_from_a_table_of_different_rows_is_kept(helpers):
    table = np.arange(32, dtype=np.float32).reshape(8, 4)
    helpers.check_pass(
        HEADER
        + f"""
        g (int64[B, S] pos) => (float[B, S, 4] y) <float[8, 4] table = {{{_floats(table)}}}> {{
            y = Gather<axis = 0>(table, pos)
        }}
        """,
        PropagateUniforms,
        modified=False,
        delta=0,
    )


def test_integer_pow_of_a_uniform_by_a_negative_exponent_does_not_crash(helpers):
    # Issue 14, cause 1 at graph level: ConstantOfShape int64 ** -1 is what ORT computes (2 ** -1 = 0).
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 3] x) => (int64[N, 3] y) <int64 e = {-1}> {
            s = Shape(x)
            two = ConstantOfShape<value = int64[1] {2}>(s)
            y = Pow(two, e)
        }
        """,
        PropagateUniforms,
        modified=True,
        delta=3,  # ConstantOfShape(Concat(Shape(x)[0:1], [3])) of 0; DCE drops the Pow chain
        dce_delta=0,
    )
    assert check.ops()["Pow"] == 0
    feeds = helpers.random_feeds(check.model, dims={"N": 2})
    np.testing.assert_array_equal(helpers.run_ort(check.model, feeds)["y"], np.zeros((2, 3), np.int64))


def test_pad_with_an_overridable_constant_value_is_not_folded(helpers):
    # Issue 14, cause 5: constant_value is an initializer that is also a graph input (a user may feed it).
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 3] x, float cv) => (float[N, 5] y) <int64[4] pads = {0, 1, 0, 1}, float cv = {0.0}> {
            zero = Mul(x, cv0)
            y = Pad(zero, pads, cv)
        }
        """.replace("float cv = {0.0}>", "float cv = {0.0}, float cv0 = {0.0}>")
    )
    result = helpers.apply_pass(PropagateUniforms(), model)
    assert model.graph.outputs[0].producer().op_type == "Pad"
    assert result.modified  # x * 0 was materialised, the Pad kept
    feeds = {"x": np.ones((2, 3), np.float32), "cv": np.asarray(7.0, np.float32)}
    got = helpers.run_ort(model, feeds)["y"]
    np.testing.assert_array_equal(got[:, 0], [7.0, 7.0])
    np.testing.assert_array_equal(got[:, 1:4], np.zeros((2, 3)))
