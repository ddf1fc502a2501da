"""liblayerzero_ort.so's ``ai.layerzero::MoE`` with activation-sparse experts (issue 23: ``gate_up_layout
"input_major"``, the x thresholds at inputs 13-14, the kept count as output 2) against the numpy reference of the
same semantics: x channel i dropped when ``|x_i| <= x_thresholds[i] * activation_scale`` (NaN kept) for the
experts' gate / up only (the router's logits are an input: routing unchanged), every other step as the dense op.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins.reference import moe_reference
from tests.plugins.ort_moe import NODE, session

E, H, F = 6, 96, 160  # F not a multiple of 64: the row kernels' column tail


def _model(wg, wu, wd, attrs, thresholds=True, outputs=3, fmt="f") -> onnx.ModelProto:
    names = ["hidden", "logits", "wg", "wu", "wd", "", "", "", "", "", "", "", ""]
    names += ["x_thresholds", "activation_scale"] if thresholds else []
    node = helper.make_node("MoE", names, ["y", "mask", "kept"][:outputs], domain="ai.layerzero", name=NODE,
                            gate_up_layout="input_major", weight_format=fmt, **attrs)  # fmt: skip
    outs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T", E]),
        helper.make_tensor_value_info("kept", TensorProto.INT64, ["T"]),
    ][:outputs]
    graph = helper.make_graph(
        [node],
        "moe",
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", H]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", E]),
            # ["K"]: a wrong size reaches the kernel (its own check)
            helper.make_tensor_value_info("x_thresholds", TensorProto.FLOAT, ["K"]),
            helper.make_tensor_value_info("activation_scale", TensorProto.FLOAT, []),
        ],
        outs,
        [numpy_helper.from_array(a, n) for a, n in ((wg, "wg"), (wu, "wu"), (wd, "wd"))],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)], ir_version=10
    )


def _weights(rng):
    wg = (rng.standard_normal((E, F, H)) / np.sqrt(H)).astype(np.float32)
    wu = (rng.standard_normal((E, F, H)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, H, F)) / np.sqrt(F)).astype(np.float32)
    return wg, wu, wd


def _stored(wg, wu, wd):
    """The input_major form: gate / up [E, H, F] (row i = input channel i); down as it is ([E, H, F])."""
    return np.ascontiguousarray(np.transpose(wg, (0, 2, 1))), np.ascontiguousarray(np.transpose(wu, (0, 2, 1))), wd


def _reference(x, logits, t, scale, wg, wu, wd, attrs):
    drop = np.abs(x) <= t * np.array(scale, np.float32)
    xm = np.where(drop, np.float32(0), x)
    # The router saw the unmasked x (its logits are the input); only the experts read xm.
    y, mask = moe_reference(xm, logits, wg, wu, wd, **attrs)
    return y, mask, (~drop).sum(axis=-1)


ATTRS = [
    dict(top_k=2, normalize=1, scoring="softmax", activation="silu"),
    dict(top_k=1, normalize=0, scoring="sigmoid", activation="gelu"),
]


@pytest.mark.parametrize("attrs", ATTRS)
@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_input_major_matches_reference(ort_lib, attrs, tokens, threads):
    rng = np.random.default_rng(tokens * 7 + threads)
    wg, wu, wd = _weights(rng)
    sess = session(ort_lib, _model(*_stored(wg, wu, wd), attrs), threads)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    logits = rng.standard_normal((tokens, E)).astype(np.float32)
    t = (np.abs(rng.standard_normal(H)) * 0.7).astype(np.float32)
    for scale in (1.0, 0.5, 0.0):
        feeds = {"hidden": x, "logits": logits, "x_thresholds": t, "activation_scale": np.array(scale, np.float32)}
        y, mask, kept = sess.run(None, feeds)
        want_y, want_mask, want_kept = _reference(x, logits, t, scale, wg, wu, wd, attrs)
        assert np.array_equal(mask, want_mask)
        assert np.array_equal(kept, want_kept)
        np.testing.assert_allclose(y, want_y, rtol=2e-5, atol=2e-5)
    if tokens:
        assert 0 < kept.max() <= H


def test_thresholds_zero_equal_the_dense_op(ort_lib):
    """Thresholds 0 keep every nonzero entry: the output-major dense op's result (within summation order)."""
    rng = np.random.default_rng(3)
    wg, wu, wd = _weights(rng)
    attrs = ATTRS[0]
    sparse = session(ort_lib, _model(*_stored(wg, wu, wd), attrs))
    dense_model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MoE", ["hidden", "logits", "wg", "wu", "wd"], ["y", "mask"], domain="ai.layerzero",
                              **attrs)],
            "dense",
            [
                helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", H]),
                helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", E]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H]),
             helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T", E])],
            [numpy_helper.from_array(a, n) for a, n in ((wg, "wg"), (wu, "wu"), (wd, "wd"))],
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)],
        ir_version=10,
    )
    dense = session(ort_lib, dense_model)
    x = rng.standard_normal((4, H)).astype(np.float32)
    x[:, ::5] = 0.0
    logits = rng.standard_normal((4, E)).astype(np.float32)
    y, _, kept = sparse.run(None, {"hidden": x, "logits": logits, "x_thresholds": np.zeros(H, np.float32),
                                   "activation_scale": np.array(1, np.float32)})  # fmt: skip
    y_dense, _ = dense.run(None, {"hidden": x, "logits": logits})
    np.testing.assert_allclose(y, y_dense, rtol=1e-5, atol=1e-6)
    assert np.array_equal(kept, (x != 0).sum(axis=-1))


def test_nan_is_kept_and_results_do_not_depend_on_threads(ort_lib):
    rng = np.random.default_rng(5)
    wg, wu, wd = _stored(*_weights(rng))
    model = _model(wg, wu, wd, ATTRS[0])
    x = rng.standard_normal((9, H)).astype(np.float32)
    logits = rng.standard_normal((9, E)).astype(np.float32)
    feeds = {"hidden": x, "logits": logits, "x_thresholds": np.full(H, 0.6, np.float32),
             "activation_scale": np.array(1, np.float32)}  # fmt: skip
    one = session(ort_lib, model, 1).run(None, feeds)
    two = session(ort_lib, model, 2).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(one, two))  # bitwise across thread counts
    x[0, 3] = np.nan
    y, _, kept = session(ort_lib, model).run(None, feeds)
    assert np.isnan(y[0]).all() and np.isfinite(y[1:]).all()
    assert kept[0] == (~(np.abs(np.nan_to_num(x[0], nan=1.0)) <= 0.6)).sum()


def test_without_the_kept_output(ort_lib):
    rng = np.random.default_rng(8)
    wg, wu, wd = _stored(*_weights(rng))
    sess = session(ort_lib, _model(wg, wu, wd, ATTRS[0], outputs=2))
    x = rng.standard_normal((2, H)).astype(np.float32)
    logits = rng.standard_normal((2, E)).astype(np.float32)
    feeds = {"x_thresholds": np.zeros(H, np.float32), "activation_scale": np.array(1, np.float32)}
    y, mask = sess.run(None, {"hidden": x, "logits": logits, **feeds})
    assert y.shape == (2, H) and mask.shape == (2, E)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("q4", "takes float experts"),
        ("no-thresholds", "needs 15 inputs"),
        ("shapes", "must all be [E, H, F]"),
    ],
)
def test_refused_when_the_session_is_made(ort_lib, case, expected):
    rng = np.random.default_rng(1)
    wg, wu, wd = _stored(*_weights(rng))
    if case == "q4":
        model = _model(wg, wu, wd, ATTRS[0], fmt="q4")
    elif case == "no-thresholds":
        model = _model(wg, wu, wd, ATTRS[0], thresholds=False)
    else:
        model = _model(wg, wu, np.ascontiguousarray(wd[:, :, :64]), ATTRS[0])
    with pytest.raises(Exception, match=expected.replace("[", r"\[").replace("]", r"\]")):
        session(ort_lib, model)


@pytest.mark.parametrize(
    "feed, expected",
    [
        (dict(x_thresholds=np.zeros(H - 1, np.float32)), "x_thresholds must be float32"),
        (dict(x_thresholds=np.full(H, -1.0, np.float32)), "finite and >= 0"),
        (dict(activation_scale=np.array(np.inf, np.float32)), "activation_scale"),
    ],
)
def test_bad_thresholds_are_one_error(ort_lib, feed, expected):
    rng = np.random.default_rng(2)
    wg, wu, wd = _stored(*_weights(rng))
    sess = session(ort_lib, _model(wg, wu, wd, ATTRS[0]))
    feeds = {"hidden": rng.standard_normal((1, H)).astype(np.float32),
             "logits": rng.standard_normal((1, E)).astype(np.float32),
             "x_thresholds": np.zeros(H, np.float32), "activation_scale": np.array(1, np.float32), **feed}  # fmt: skip
    with pytest.raises(Exception, match=expected):
        sess.run(None, feeds)
