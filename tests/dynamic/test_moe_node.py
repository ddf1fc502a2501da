"""``passes/_moe_node.MoENode``: the one reader / writer of ``ai.layerzero::MoE`` and its fixed input layout."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.contract import THRESHOLD_INPUT
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
from layerzero.passes._moe_node import INPUTS, THRESHOLD_SLOT, MoENode, is_moe_node
from layerzero.passes.lower_moe import LowerMoE
from layerzero.plugins.reference import moe_reference

CONFIG = MoEConfig(form="skipping", hidden=16, ffn=32, experts=4, top_k=2)


def _node(model: ir.Model) -> ir.Node:
    (node,) = [n for n in model.graph if is_moe_node(n)]
    return node


def test_of_then_to_node_is_the_same_node() -> None:
    model = ir.from_proto(build_moe(CONFIG))
    node = _node(model)
    view = MoENode.of(node)
    assert (view.top_k, view.normalize, view.scoring, view.path) == (2, True, "softmax", "layers.0.moe")
    again = view.to_node(name="copy")
    assert list(again.inputs) == list(node.inputs)
    assert {k: a.value for k, a in again.attributes.items()} == {k: a.value for k, a in node.attributes.items()}
    assert MoENode.of(again) == view


def test_each_input_has_one_slot_and_trailing_empty_slots_are_dropped() -> None:
    model = ir.from_proto(build_moe(CONFIG))
    view = MoENode.of(_node(model))
    assert len(view.inputs) == 5
    view.score_bias = view.w_gate  # any value: only the positions are checked here
    assert len(view.inputs) == INPUTS.index("score_bias") + 1 and view.inputs[5:8] == [None] * 3
    view.threshold = view.hidden
    assert len(view.inputs) == THRESHOLD_SLOT + 1 and view.inputs[THRESHOLD_SLOT] is view.hidden


def test_the_earlier_six_input_layout_reads_its_input_5_as_the_threshold() -> None:
    model = ir.from_proto(build_moe(CONFIG))
    node = _node(model)
    threshold = ir.Value(name=THRESHOLD_INPUT, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    node.resize_inputs(6)
    node.replace_input_with(5, threshold)
    view = MoENode.of(node)
    assert view.threshold is threshold and view.b_gate is None


def _session(model: ir.Model) -> ort.InferenceSession:
    proto = ir.to_proto(model)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_b_gate_named_like_the_threshold_is_read_as_b_gate() -> None:
    # Before MoENode, lower_moe read an input 5 called "layerzero::threshold" as the native lowering's threshold
    # and dropped the bias: the lowered block computed without it. The slot decides now, not the name.
    proto = build_moe(CONFIG)
    model = ir.from_proto(proto)
    node = _node(model)
    rng = np.random.default_rng(3)
    b_gate = rng.standard_normal((CONFIG.experts, CONFIG.ffn)).astype(np.float32)
    bias = ir.Value(name=THRESHOLD_INPUT, const_value=ir.tensor(b_gate, name=THRESHOLD_INPUT))
    bias.dtype, bias.shape = ir.DataType.FLOAT, ir.Shape(b_gate.shape)
    model.graph.register_initializer(bias)
    node.resize_inputs(6)
    node.replace_input_with(5, bias)
    assert LowerMoE(lowering="if")(model).modified
    feeds = moe_feeds(CONFIG, tokens=6, seed=1)
    (x,) = feeds.values()
    session = _session(model)
    out = session.run(None, {session.get_inputs()[0].name: x})[0]
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    path = CONFIG.path(0)
    logits = x @ weights[f"{path}.gate.weight"].T + weights[f"{path}.gate.bias"]
    expected, _ = moe_reference(
        x,
        logits,
        weights[f"{path}.experts.w_gate"],
        weights[f"{path}.experts.w_up"],
        weights[f"{path}.experts.w_down"],
        top_k=CONFIG.top_k,
        normalize=CONFIG.normalize,
        scoring=CONFIG.scoring,
        activation=CONFIG.activation,
        b_gate=b_gate,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_of_refuses_another_op() -> None:
    with pytest.raises(ValueError, match=r"is not ai\.layerzero::MoE"):
        MoENode.of(ir.Node("", "Add", []))
