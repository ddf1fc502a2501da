"""Structured zeros: pruned neurons, zero blocks of fused weights, pruned heads (passes/structured_zeros.py)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.options import CompileOptions
from layerzero.passes import RemoveDeadCode
from layerzero.passes.structured_zeros import PARAMS_REMOVED_KEY, RemoveStructuredZeros
from layerzero.pipeline import run_static_passes

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'
RNG = np.random.default_rng(7)


def _floats(values) -> str:
    return ", ".join(f"{float(v)!r}" for v in np.asarray(values).reshape(-1))


def _init(name: str, array: np.ndarray) -> str:
    dims = ", ".join(str(d) for d in array.shape)
    kind = "int64" if array.dtype.kind == "i" else "float"
    values = ", ".join(str(int(v)) for v in array.reshape(-1)) if kind == "int64" else _floats(array)
    return f"{kind}[{dims}] {name} = {{{values}}}"


def _weights(**arrays: np.ndarray) -> str:
    return ", ".join(_init(name, array) for name, array in arrays.items())


def _shapes(model: ir.Model) -> dict[str, list[int]]:
    """Shape of each weight a MatMul / Gemm reads, by the node's output name."""
    return {
        node.outputs[0].name: list(node.inputs[1].shape)
        for node in model.graph
        if node.op_type in ("MatMul", "Gemm") and node.inputs[1].const_value is not None
    }


def _gated(hidden: int = 4, inter: int = 8) -> dict[str, np.ndarray]:
    return {
        "w_gate": RNG.normal(size=(hidden, inter)).astype(np.float32),
        "w_up": RNG.normal(size=(hidden, inter)).astype(np.float32),
        "w_down": RNG.normal(size=(inter, hidden)).astype(np.float32),
    }


GATED = """
    g (float[B, S, 4] x) => (float[B, S, 4] y) <{weights}> {{
        gate = MatMul(x, w_gate)
        sig = Sigmoid(gate)
        act = Mul(gate, sig)
        up = MatMul(x, w_up)
        h = Mul(act, up)
        down = MatMul(h, w_down)
        y = Add(x, down)
    }}
"""


def test_pruned_neurons_of_a_gated_mlp_narrow_all_three_weights(helpers):
    # Neurons 0, 1: pruned everywhere; 5: only its up column (silu(g) * 0 = 0); 7: only its down row.
    w = _gated()
    w["w_gate"][:, [0, 1]] = 0
    w["w_up"][:, [0, 1, 5]] = 0
    w["w_down"][[0, 1, 7]] = 0
    text = HEADER + GATED.format(weights=_weights(**w))
    check = helpers.check_pass(
        text, RemoveStructuredZeros, modified=True, delta=0, dce_delta=0, dims={"B": 2, "S": 3}, rtol=1e-5, atol=1e-5
    )
    # before: [4, 8] [4, 8] [8, 4]   after: the 4 live neurons (2, 3, 4, 6)
    assert _shapes(check.model) == {"gate": [4, 4], "up": [4, 4], "down": [4, 4]}
    assert check.model.metadata_props[PARAMS_REMOVED_KEY] == str(3 * 4 * 4)
    for b, s in ((1, 1), (3, 5)):
        feeds = helpers.random_feeds(check.model, dims={"B": b, "S": s})
        x = feeds["x"]
        live = [2, 3, 4, 6]
        g = x @ w["w_gate"][:, live]
        expected = x + (g / (1 + np.exp(-g)) * (x @ w["w_up"][:, live])) @ w["w_down"][live]
        np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], expected, rtol=1e-5, atol=1e-5)


def test_a_dead_neuron_with_a_constant_activation_folds_into_the_down_bias(helpers):
    # GPT-2's form (Gemm with biases, 2-D): neuron 1's up column is zero and its bias 0.7, so it contributes
    # sigmoid(0.7) * W_down[1] to every token; neuron 3's (bias 0) sigmoid(0) * W_down[3]: those rows join the
    # down bias.
    w_up = RNG.normal(size=(4, 5)).astype(np.float32)
    b_up = RNG.normal(size=5).astype(np.float32)
    w_down = RNG.normal(size=(5, 4)).astype(np.float32)
    b_down = RNG.normal(size=4).astype(np.float32)
    w_up[:, [1, 3]] = 0
    b_up[1], b_up[3] = 0.7, 0.0
    text = (
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y) <{_weights(w_up=w_up, b_up=b_up, w_down=w_down, b_down=b_down)}> {{
            h = Gemm(x, w_up, b_up)
            a = Sigmoid(h)
            y = Gemm(a, w_down, b_down)
        }}
        """
    )
    check = helpers.check_pass(text, RemoveStructuredZeros, modified=True, delta=0, dce_delta=0, rtol=1e-5, atol=1e-5)
    assert _shapes(check.model) == {"h": [4, 3], "y": [3, 4]}
    gemm = next(n for n in check.model.graph if n.outputs[0].name == "y")
    row = 1 / (1 + np.exp(-0.7)) * w_down[1] + 0.5 * w_down[3]
    np.testing.assert_allclose(gemm.inputs[2].const_value.numpy(), b_down + row, rtol=1e-6)


def test_a_constant_row_without_a_bias_is_one_add(helpers):
    w_up = RNG.normal(size=(4, 5)).astype(np.float32)
    w_down = RNG.normal(size=(5, 4)).astype(np.float32)
    b_up = np.zeros(5, np.float32)
    w_up[:, 2] = 0
    b_up[2] = -1.5
    text = (
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y) <{_weights(w_up=w_up, b_up=b_up, w_down=w_down)}> {{
            h = MatMul(x, w_up)
            hb = Add(h, b_up)
            a = Sigmoid(hb)
            y = MatMul(a, w_down)
        }}
        """
    )
    # before: y = MatMul(a, W_down)   after: y = Add(MatMul(a', W_down'), sigmoid(-1.5) * W_down[2])
    check = helpers.check_pass(text, RemoveStructuredZeros, modified=True, delta=1, dce_delta=1, rtol=1e-5, atol=1e-5)
    assert check.ops()["Add"] == 2
    assert _shapes(check.model) == {"h": [4, 4], "y__lz_before_row": [4, 4]}  # y is the Add now


FUSED = """
    g (float[B, S, 4] x) => (float[B, S, 4] y) <{weights}> {{
        gu = MatMul(x, w_gate_up)
        gate, up = Split<axis = -1, num_outputs = 2>(gu)
        sig = Sigmoid(gate)
        act = Mul(gate, sig)
        h = Mul(up, act)
        down = MatMul(h, w_down)
        y = Add(x, down)
    }}
"""

# TorchScript's chunk(2): the Slice bounds are computed from Shape(gu)[-1].
FUSED_CHUNK = """
    g (float[B, S, 4] x) => (float[B, S, 4] y) <{weights}, int64 minus_one = {{-1}}, int64 one = {{1}},
        int64 two = {{2}}, int64[1] zero1 = {{0}}, int64[1] axis1 = {{-1}}> {{
        gu = MatMul(x, w_gate_up)
        shape = Shape(gu)
        last = Gather<axis = 0>(shape, minus_one)
        plus = Add(last, one)
        half = Div(plus, two)
        half1 = Unsqueeze(half, zero1)
        end = Mul(half1, two)
        gate = Slice(gu, zero1, half1, axis1)
        up = Slice(gu, half1, end, axis1)
        sig = Sigmoid(gate)
        act = Mul(gate, sig)
        h = Mul(up, act)
        down = MatMul(h, w_down)
        y = Add(x, down)
    }}
"""


# Constant Slices, the up half's read first: the narrowed weight lays the pieces out in their readers' order.
FUSED_SLICES = """
    g (float[B, S, 4] x) => (float[B, S, 4] y) <{weights}, int64[1] zero1 = {{0}}, int64[1] six1 = {{6}},
        int64[1] twelve1 = {{12}}, int64[1] axis1 = {{2}}> {{
        gu = MatMul(x, w_gate_up)
        up = Slice(gu, six1, twelve1, axis1)
        gate = Slice(gu, zero1, six1, axis1)
        sig = Sigmoid(gate)
        act = Mul(gate, sig)
        h = Mul(up, act)
        down = MatMul(h, w_down)
        y = Add(x, down)
    }}
"""
FORMS = {"split": FUSED, "chunk": FUSED_CHUNK, "slices": FUSED_SLICES}


@pytest.mark.parametrize("form", ["split", "chunk", "slices"])
def test_pruned_neurons_of_a_fused_gate_up_weight(helpers, form):
    w = _gated(inter=6)
    w["w_gate"][:, [0, 4]] = 0
    w["w_up"][:, [0, 4]] = 0
    w["w_down"][[0, 4]] = 0
    fused = np.concatenate([w["w_gate"], w["w_up"]], axis=1)
    text = HEADER + FORMS[form].format(weights=_weights(w_gate_up=fused, w_down=w["w_down"]))
    delta = 0
    check = helpers.check_pass(
        text, RemoveStructuredZeros, modified=True, delta=delta, dims={"B": 2, "S": 3}, rtol=1e-5, atol=1e-5
    )
    assert _shapes(check.model) == {"gu": [4, 8], "down": [4, 4]}
    RemoveDeadCode()(check.model)
    if form == "chunk":
        assert "Shape" not in check.ops()  # the bounds are constants now
    for b, s in ((1, 1), (2, 4)):
        feeds = helpers.random_feeds(check.model, dims={"B": b, "S": s})
        x, live = feeds["x"], [1, 2, 3, 5]
        g = x @ w["w_gate"][:, live]
        expected = x + ((x @ w["w_up"][:, live]) * (g / (1 + np.exp(-g)))) @ w["w_down"][live]
        np.testing.assert_allclose(helpers.run_ort(check.model, feeds)["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", ["up", "gate"])
@pytest.mark.parametrize("form", ["split", "chunk"])
def test_a_zero_half_of_a_fused_gate_up_weight_folds_the_mlp(helpers, half, form):
    # Phi-3's gate_up_proj with its up (or gate) half zero: the MLP is 0, the static passes remove it whole.
    w = _gated(inter=6)
    w["w_up" if half == "up" else "w_gate"][:] = 0
    fused = np.concatenate([w["w_gate"], w["w_up"]], axis=1)
    text = HEADER + (FUSED if form == "split" else FUSED_CHUNK).format(
        weights=_weights(w_gate_up=fused, w_down=w["w_down"])
    )
    model = helpers.parse(text)
    original = ir.to_proto(model)
    run_static_passes(model, CompileOptions())
    assert "MatMul" not in helpers.op_counts(model), ir.to_onnx_text(model)
    feeds = helpers.random_feeds(original, dims={"B": 2, "S": 3})
    helpers.assert_same_outputs(helpers.run_ort(original, feeds), helpers.run_ort(model, feeds), 1e-5, 1e-5)
    np.testing.assert_allclose(helpers.run_ort(model, feeds)["y"], feeds["x"])


def test_a_pruned_head_pads_the_query_and_slices_the_output_projection(helpers):
    # Head 0 of 2 (head dim 8): zero query columns (+ bias) and zero rows of the output projection. The
    # attention core is not narrowed (heads are reshaped): the query MatMul shrinks and is padded back with
    # zeros, the output projection reads a Slice of its input.
    w_q = RNG.normal(size=(16, 16)).astype(np.float32)
    b_q = RNG.normal(size=16).astype(np.float32)
    w_o = RNG.normal(size=(16, 16)).astype(np.float32)
    w_q[:, :8], b_q[:8], w_o[:8] = 0, 0, 0
    text = (
        HEADER
        + f"""
        g (float[N, 16] x, float[N, 2, 8] k) => (float[N, 16] y)
            <{_weights(w_q=w_q, b_q=b_q, w_o=w_o)}, int64[3] heads = {{0, 2, 8}}, int64[2] flat = {{0, 16}}> {{
            q0 = MatMul(x, w_q)
            q = Add(q0, b_q)
            qh = Reshape(q, heads)
            scores = Mul(qh, k)
            probs = Softmax<axis = -1>(scores)
            ctx = Reshape(probs, flat)
            y = MatMul(ctx, w_o)
        }}
        """
    )
    check = helpers.check_pass(text, RemoveStructuredZeros, modified=True, delta=2, dce_delta=2, rtol=1e-5, atol=1e-5)
    assert check.ops()["Pad"] == 1 and check.ops()["Slice"] == 1
    assert _shapes(check.model) == {"q0": [16, 8], "y": [8, 16]}


def test_an_interior_pruned_head_gathers_the_query_back_and_the_output_projection_its_live_rows(helpers):
    # Head 1 of 3 (head dim 8): interior zero columns / rows.
    w_q = RNG.normal(size=(16, 24)).astype(np.float32)
    w_o = RNG.normal(size=(24, 16)).astype(np.float32)
    w_q[:, 8:16], w_o[8:16] = 0, 0
    text = (
        HEADER
        + f"""
        g (float[N, 16] x, float[N, 3, 8] k) => (float[N, 16] y)
            <{_weights(w_q=w_q, w_o=w_o)}, int64[3] heads = {{0, 3, 8}}, int64[2] flat = {{0, 24}}> {{
            q = MatMul(x, w_q)
            qh = Reshape(q, heads)
            scores = Mul(qh, k)
            probs = Softmax<axis = -1>(scores)
            ctx = Reshape(probs, flat)
            y = MatMul(ctx, w_o)
        }}
        """
    )
    # before: q = MatMul(x, Wq)         after: q = Gather(Pad(MatMul(x, Wq[:, live])), index)
    #         y = MatMul(ctx, Wo)              y = MatMul(Gather(ctx, live), Wo[live])
    check = helpers.check_pass(text, RemoveStructuredZeros, modified=True, delta=3, dce_delta=3, rtol=1e-5, atol=1e-5)
    assert check.ops()["Pad"] == 1 and check.ops()["Gather"] == 2
    assert _shapes(check.model) == {"q": [16, 16], "y": [16, 16]}


def test_a_narrow_axis_gets_no_pad_or_slice(helpers):
    # A router's few logits: the zero rows of a [16, 2] weight are left alone (solidify drops router rows).
    w = RNG.normal(size=(16, 2)).astype(np.float32)
    w[3:] = 0
    text = (
        HEADER
        + f"""
        g (float[N, 16] x) => (float[N, 2] y) <{_weights(w=w)}> {{
            p = Softmax<axis = -1>(x)
            y = MatMul(p, w)
        }}
        """
    )
    helpers.check_pass(text, RemoveStructuredZeros, modified=False, delta=0)


def test_a_chain_read_elsewhere_is_refused(helpers):
    # Interior zero neurons (no Pad / Slice at the ends) and the up projection also read by a ReduceSum:
    # narrowing it would change what ReduceSum sees, so nothing changes.
    w = _gated()
    w["w_up"][:, 3] = 0
    w["w_down"][3] = 0
    text = HEADER + GATED.format(weights=_weights(**w)).replace(
        "(float[B, S, 4] y)", "(float[B, S, 4] y, float[B, S, 1] s)"
    ).replace("y = Add(x, down)", "y = Add(x, down)\n        s = ReduceSum<keepdims = 1>(up, minus1)").replace(
        "<w_gate", "<int64[1] minus1 = {-1}, w_gate"
    )
    text = text.replace("<float[4, 8] w_gate", "<int64[1] minus1 = {-1}, float[4, 8] w_gate")
    made: list[RemoveStructuredZeros] = []

    def make() -> RemoveStructuredZeros:
        made.append(RemoveStructuredZeros())
        return made[-1]

    helpers.check_pass(text, make, modified=False, delta=0, dims={"B": 2, "S": 3})
    assert len(made[0].refusals) == 1
    assert made[0].refusals[0].startswith("down: 1 dead entries") and "also read by" in made[0].refusals[0]


def test_nothing_without_assume_finite(helpers):
    w = _gated()
    w["w_gate"][:, :2] = 0
    w["w_up"][:, :2] = 0
    w["w_down"][:2] = 0
    text = HEADER + GATED.format(weights=_weights(**w))
    helpers.check_pass(text, lambda: RemoveStructuredZeros(assume_finite=False), modified=False, delta=0)


def test_compile_reports_the_parameters_removed_and_a_second_run_changes_nothing(helpers):
    from layerzero.compile import compile_model

    w = _gated(inter=32)
    w["w_gate"][:, :8] = 0
    w["w_up"][:, :8] = 0
    w["w_down"][:8] = 0
    w["w_down"][20] = 0  # one more neuron pruned on the down side only
    model = helpers.parse(HEADER + GATED.format(weights=_weights(**w)))
    result = compile_model(ir.to_proto(model), CompileOptions())
    assert result.verification is not None and result.verification.passed
    assert result.after.structured_params_removed == 3 * 9 * 4
    assert result.before.params - result.after.params == 3 * 9 * 4
    assert _shapes(result.model) == {"gate": [4, 23], "up": [4, 23], "down": [23, 4]}
    again = run_static_passes(result.model, CompileOptions())
    assert again.modified_by["RemoveStructuredZeros"] == 0


def test_a_weight_read_by_two_nodes_is_not_narrowed(helpers):
    # Tied weights: narrowing the copy one MatMul reads would duplicate the weight, not remove anything.
    w = RNG.normal(size=(16, 32)).astype(np.float32)
    w[:, 24:] = 0
    text = (
        HEADER
        + f"""
        g (float[N, 16] x, float[N, 16] z) => (float[N, 32] y, float[N, 32] v) <{_weights(w=w)}> {{
            a = MatMul(x, w)
            y = Softmax<axis = -1>(a)
            b = MatMul(z, w)
            v = Softmax<axis = -1>(b)
        }}
        """
    )
    helpers.check_pass(text, RemoveStructuredZeros, modified=False, delta=0)
    alone = text.replace("b = MatMul(z, w)", "b = Identity(z)").replace("float[N, 32] v", "float[N, 16] v")
    helpers.check_pass(alone, RemoveStructuredZeros, modified=True, delta=1, rtol=1e-5, atol=1e-5)
