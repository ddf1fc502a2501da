"""liblayerzero_ort.so's ``ai.layerzero::MoE`` with its router in the op (inputs 15-16, output 3; written by
``passes/native_router.py``): the logits ``hidden @ router_weight^T + router_bias`` computed by the op, the routing
and y equal to the same node fed those logits, the confidence output equal to ``ReduceMax(Softmax | Sigmoid)``,
hidden of any rank, float and q4 experts, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.plugins.ort_moe import NODE, session
from tests.plugins.test_ort_native import _weights
from tests.plugins.test_ort_quant import quant_model

E, F, H = 8, 40, 64
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)]


def _router(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32), rng.standard_normal(E).astype(np.float32)


def _model(in_op: bool, rank: int = 2, bias: bool = True, confidence: bool = True, **attrs) -> onnx.ModelProto:
    """One float MoE node: with ``in_op`` the router at inputs 15-16 (input 1 empty), else the logits as input 1
    computed by a Gemm in the graph and the confidence by Softmax / Sigmoid + ReduceMax."""
    w, b = _router(1)
    inits = [numpy_helper.from_array(a, n) for n, a in zip(("w_gate", "w_up", "w_down"), _weights(E, F, H, 0))]
    inits += [numpy_helper.from_array(w, "rw")] + ([numpy_helper.from_array(b, "rb")] if bias else [])
    shape = ["B", "T", H][-rank:] if rank > 1 else [H]
    nodes, outputs = [], ["y", "mask"]
    scoring = str(attrs.get("scoring", "softmax"))
    if in_op:
        names = ["hidden", "", "w_gate", "w_up", "w_down"] + [""] * 10 + ["rw"] + (["rb"] if bias else [])
        outputs += ["", "confidence"] if confidence else []
    else:
        nodes.append(helper.make_node("Reshape", ["hidden", "flat_shape"], ["x2"]))
        inits.append(numpy_helper.from_array(np.array([-1, H], np.int64), "flat_shape"))
        nodes.append(helper.make_node("Gemm", ["x2", "rw"] + (["rb"] if bias else []), ["logits"], transB=1))
        nodes.append(helper.make_node("Softmax" if scoring == "softmax" else "Sigmoid", ["logits"], ["scores"],
                                      **({"axis": -1} if scoring == "softmax" else {})))  # fmt: skip
        nodes.append(helper.make_node("ReduceMax", ["scores", "axes"], ["confidence"], keepdims=0))
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
        names = ["x2", "logits", "w_gate", "w_up", "w_down"]
        nodes.append(helper.make_node("MoE", names, ["y2", "mask"], domain="ai.layerzero", name=NODE, **attrs))
        nodes.append(helper.make_node("Shape", ["hidden"], ["hidden_shape"]))
        nodes.append(helper.make_node("Reshape", ["y2", "hidden_shape"], ["y"], allowzero=1))
    if in_op:
        nodes.append(helper.make_node("MoE", names, outputs, domain="ai.layerzero", name=NODE, **attrs))
    graph_outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                     helper.make_tensor_value_info("mask", TensorProto.BOOL, None)]  # fmt: skip
    if confidence:
        graph_outputs.append(helper.make_tensor_value_info("confidence", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, shape)],
                              graph_outputs, inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("scoring", "normalize", "bias"), [("softmax", 1, True), ("sigmoid", 1, False),
                                                            ("softmax", 0, False)])  # fmt: skip
@pytest.mark.parametrize("shape", [(1, 1), (2, 5), (1, 0), (3, 70)])
def test_router_in_the_op_equals_the_graph_router(ort_lib, threads, scoring, normalize, bias, shape):
    """Same routing (mask exactly), y and confidence to float32 rounding, for [B, T, H] hidden (the block's own
    shape, y in it too) against the graph's Reshape -> Gemm -> MoE -> Reshape."""
    attrs = {"top_k": 2, "normalize": normalize, "scoring": scoring}
    fused = session(ort_lib, _model(True, rank=3, bias=bias, **attrs), threads)
    base = session(ort_lib, _model(False, rank=3, bias=bias, **attrs), threads)
    x = np.random.default_rng(sum(shape)).standard_normal((*shape, H)).astype(np.float32)
    y, mask, conf = fused.run(None, {"hidden": x})
    y0, mask0, conf0 = base.run(None, {"hidden": x})
    assert y.shape == y0.shape == x.shape and mask.shape == mask0.shape == (shape[0] * shape[1], E)
    assert conf.shape == conf0.shape == (shape[0] * shape[1],) and conf.dtype == np.float32
    assert np.array_equal(mask, mask0)
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conf, conf0, rtol=1e-6, atol=1e-7)


def test_confidence_is_optional_and_hidden_may_be_2d(ort_lib):
    x = np.random.default_rng(3).standard_normal((6, H)).astype(np.float32)
    y, mask = session(ort_lib, _model(True, rank=2, confidence=False, top_k=2)).run(None, {"hidden": x})
    y0, mask0, _ = session(ort_lib, _model(False, rank=2, top_k=2)).run(None, {"hidden": x})
    assert y.shape == (6, H) and np.array_equal(mask, mask0)
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-6)


def test_nan_logits_give_nan_confidence_and_no_expert(ort_lib):
    x = np.random.default_rng(4).standard_normal((1, 3, H)).astype(np.float32)
    x[0, 1, 5] = np.nan
    _, mask, conf = session(ort_lib, _model(True, rank=3, top_k=2)).run(None, {"hidden": x})
    assert np.isnan(conf[1]) and not mask[1].any() and np.isfinite(conf[[0, 2]]).all()


def test_quantized_experts_with_the_router_in_the_op(ort_lib):
    """A q4 node of 17 inputs (scales at 10-12, the router at 15-16): the same y and mask as the 13-input node fed
    the logits."""
    w, b = _router(2)
    base, _ = quant_model(experts=E, ffn=64, hidden=H, bits=4, top_k=2, normalize=1)
    fused = onnx.ModelProto()
    fused.CopyFrom(base)
    node = fused.graph.node[0]
    node.input[1] = ""
    node.input.extend(["", "", "rw", "rb"])
    node.output.extend(["", "confidence"])
    fused.graph.initializer.extend([numpy_helper.from_array(w, "rw"), numpy_helper.from_array(b, "rb")])
    fused.graph.input.remove(next(i for i in fused.graph.input if i.name == "logits"))
    fused.graph.output.append(helper.make_tensor_value_info("confidence", TensorProto.FLOAT, None))
    x = np.random.default_rng(5).standard_normal((5, H)).astype(np.float32)
    logits = (x.astype(np.float64) @ w.T.astype(np.float64) + b).astype(np.float32)
    y, mask, conf = session(ort_lib, fused).run(None, {"hidden": x})
    y0, mask0 = session(ort_lib, base).run(None, {"hidden": x, "logits": logits})
    assert np.array_equal(mask, mask0)
    np.testing.assert_allclose(y, y0, rtol=1e-4, atol=1e-5)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(conf, (p / p.sum(-1, keepdims=True)).max(-1), rtol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda n, g: n.input.__setitem__(1, "hidden"), "(input 1) or router_weight (input 15), not both"),
        (lambda n, g: n.input.__setitem__(15, ""), "needs router_logits (input 1) or router_weight (input 15)"),
        (lambda n, g: n.input.__setitem__(16, "w_gate"), "router_bias (input 16) must be float32 [8]"),
        (lambda n, g: n.input.__setitem__(15, "rb"), "router_weight (input 15) must be float32 [8, 64]"),
    ],
    ids=["both", "neither", "bias-shape", "weight-shape"],
)
def test_bad_router_inputs_are_one_line(ort_lib, edit, message):
    model = _model(True, rank=3)
    edit(model.graph.node[0], model.graph)
    x = np.zeros((1, 2, H), np.float32)
    with pytest.raises(Exception) as failure:
        session(ort_lib, model).run(None, {"hidden": x})
    text = str(failure.value)
    assert message in text and NODE in text and "\n" not in text.strip(), text
