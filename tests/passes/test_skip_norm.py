"""``FuseSkipNorm`` (passes/skip_norm.py) on the corpus' generate exports after ``FuseDecoder``: every residual Add
followed by an RMS norm becomes one ``com.microsoft.SkipSimplifiedLayerNormalization`` (its sum, output 3, read by
the next residual Add); logits and presents equal the unfused graph's on ONNX Runtime to float32 rounding (left-padded
prefill and decode); a second run changes nothing; a broadcasting Add is left."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.options import CompileOptions
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.skip_norm import FuseSkipNorm
from layerzero.pipeline import fuse_decoder
from tests.passes.test_fuse_decoder import LAYERS, _feeds
from tests.passes.test_fuse_decoder import _export as corpus_export


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_residual_adds_and_norms_fuse_with_the_same_outputs(family):
    model = ir.load(corpus_export(family))
    fuse_decoder(model, CompileOptions())
    base = ir.from_proto(ir.serde.serialize_model(model))
    InferShapes()(model)
    step = FuseSkipNorm()
    step(model)
    # Each layer's two residual Adds each feed a norm (the next layer's input norm, or the final one).
    assert len(step.fused) == 2 * LAYERS
    before, after = Counter(n.op_type for n in base.graph), Counter(n.op_type for n in model.graph)
    assert after["SkipSimplifiedLayerNormalization"] == 2 * LAYERS
    assert before["SimplifiedLayerNormalization"] - after["SimplifiedLayerNormalization"] == 2 * LAYERS
    assert before["Add"] - after["Add"] == 2 * LAYERS
    s0, s1 = _session(base), _session(model)
    for label, (batch, seq, past) in {"prefill": (2, 6, 0), "decode": (2, 1, 5)}.items():
        feeds = _feeds(base, batch, seq, past, seed=len(label))
        for name, a, b in zip([o.name for o in s0.get_outputs()], s0.run(None, feeds), s1.run(None, feeds)):
            scale = max(float(np.abs(a).max()), 1e-30)
            assert float(np.abs(b - a).max()) <= 1e-5 * scale, (label, name)
    again = FuseSkipNorm()
    assert not again(model).modified and again.fused == []


def test_a_broadcasting_add_is_left():
    """Add([B, T, H], [H]) then the norm: SkipSimplifiedLayerNormalization's skip must be the input's shape."""
    H = 8
    nodes = [helper.make_node("Add", ["x", "bias"], ["s"]),
             helper.make_node("SimplifiedLayerNormalization", ["s", "g"], ["y"], axis=-1, epsilon=1e-6)]  # fmt: skip
    inits = [
        numpy_helper.from_array(np.ones(H, np.float32), "bias"),
        numpy_helper.from_array(np.ones(H, np.float32), "g"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    InferShapes()(model)
    step = FuseSkipNorm()
    assert not step(model).modified and step.fused == []
