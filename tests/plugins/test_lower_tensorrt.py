"""``LowerMoEToTensorRT``: the skipping form becomes the node TensorRT's ONNX parser turns into the plugin.

Parser conventions (onnx-tensorrt's fallback plugin importer): op_type = the plugin name, attributes
``plugin_namespace`` / ``plugin_version`` select the creator, every other attribute is a plugin field.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from layerzero.errors import UnsupportedModelError
from layerzero.passes.lower_tensorrt import (
    PLUGIN_DOMAIN,
    PLUGIN_FIELDS,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    LowerMoEToTensorRT,
)
from layerzero.passes.shape_inference import InferShapes

MASK = "layerzero::mask::layers.0.moe"


def infer_shapes(model: ir.Model) -> None:
    """What the compile pipeline runs before every pass (the lowering reads dtypes and shapes)."""
    InferShapes()(model)


def lower(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    model = ir.from_proto(proto)
    infer_shapes(model)
    result = LowerMoEToTensorRT()(model)
    return ir.to_proto(model), result.modified


def ops(proto: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in proto.graph.node]


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_moe_node_becomes_the_plugin_node_with_parser_attributes(moe_model):
    before = moe_model(attributes={"zeroing_threshold": 0.25, "scoring": "sigmoid", "activation": "gelu"})
    after, modified = lower(before)
    assert modified
    assert ops(after) == [("", "Gemm"), (PLUGIN_DOMAIN, PLUGIN_NAME), ("", "Cast")]
    plugin = after.graph.node[1]
    a = attrs(plugin)
    assert a["plugin_namespace"] == PLUGIN_NAMESPACE.encode() == b"layerzero"
    assert a["plugin_version"] == PLUGIN_VERSION.encode() == b"1"
    assert set(a) == {"plugin_namespace", "plugin_version", *PLUGIN_FIELDS}
    assert a["top_k"] == 2 and a["normalize"] == 1
    assert a["scoring"] == b"sigmoid" and a["activation"] == b"gelu"
    assert a["zeroing_threshold"] == pytest.approx(0.25)
    kinds = {x.name: x.type for x in plugin.attribute}
    assert kinds["top_k"] == kinds["normalize"] == onnx.AttributeProto.INT  # parser: kINT32 fields
    assert kinds["zeroing_threshold"] == onnx.AttributeProto.FLOAT  # kFLOAT32
    assert kinds["scoring"] == kinds["activation"] == onnx.AttributeProto.STRING  # kCHAR
    assert {p.key: p.value for p in plugin.metadata_props} == {"layerzero.path": "layers.0.moe"}
    assert plugin.name == "layers.0.moe"
    assert list(plugin.input) == ["hidden", "logits", "w_gate", "w_up", "w_down"]


def test_mask_is_cast_back_to_bool_and_output_names_stay(moe_model):
    after, _ = lower(moe_model())
    plugin, cast = after.graph.node[1], after.graph.node[2]
    assert [o.name for o in after.graph.output] == ["y", MASK]
    assert plugin.output[0] == "y"
    assert cast.input[0] == plugin.output[1] and cast.output[0] == MASK
    assert attrs(cast)["to"] == TensorProto.BOOL
    infos = {v.name: v for v in after.graph.value_info}
    assert infos[plugin.output[1]].type.tensor_type.elem_type == TensorProto.INT32
    opsets = {o.domain: o.version for o in after.opset_import}
    assert opsets[PLUGIN_DOMAIN] == 1 and "ai.layerzero" not in opsets


def test_lowered_model_passes_the_onnx_checker(moe_model):
    after, _ = lower(moe_model())
    onnx.checker.check_model(after, full_check=True)


def test_second_run_changes_nothing(moe_model):
    model = ir.from_proto(moe_model())
    assert LowerMoEToTensorRT()(model).modified
    assert not LowerMoEToTensorRT()(model).modified


def test_model_without_moe_is_untouched(moe_model):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    after, modified = lower(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert not modified and ops(after) == [("", "Relu")]


def test_unused_mask_gets_no_cast(moe_model):
    after, _ = lower(moe_model(mask_output=False))
    assert ops(after) == [("", "Gemm"), (PLUGIN_DOMAIN, PLUGIN_NAME)]
    assert [o.name for o in after.graph.output] == ["y"]


def test_logits_of_another_dtype_are_cast_to_hidden_dtype(moe_model):
    after, _ = lower(moe_model(dtype=TensorProto.FLOAT16, logits_dtype=TensorProto.FLOAT))
    plugin = next(n for n in after.graph.node if n.op_type == PLUGIN_NAME)
    producer = {o: n for n in after.graph.node for o in n.output}[plugin.input[1]]
    assert producer.op_type == "Cast" and attrs(producer)["to"] == TensorProto.FLOAT16
    onnx.checker.check_model(after, full_check=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": 40}, "top_k must be an int in"),
        ({"top_k": 5}, "exceeds the number of experts E = 4"),
        ({"scoring": "sparsemax"}, "scoring 'sparsemax'"),
        ({"activation": "tanh"}, "activation 'tanh'"),
        ({"normalize": 3}, "normalize must be 0 or 1"),
        ({"zeroing_threshold": -0.5}, "zeroing_threshold must be finite and >= 0"),
    ],
)
def test_bad_attributes_name_the_node(moe_model, change, message):
    model = ir.from_proto(moe_model(attributes=change))
    with pytest.raises(UnsupportedModelError, match=message) as info:
        LowerMoEToTensorRT()(model)
    assert "'layers.0.moe'" in str(info.value)


def test_non_float_hidden_is_rejected(moe_model):
    proto = moe_model()
    model = ir.from_proto(proto)
    hidden = model.graph.inputs[0]
    hidden.dtype = ir.DataType.INT32
    with pytest.raises(UnsupportedModelError, match="float32, float16 or bfloat16"):
        LowerMoEToTensorRT()(model)


def test_the_example_skipping_model_lowers_too():
    moe = pytest.importorskip("layerzero.models.moe")
    proto = moe.build_moe(moe.MoEConfig(form="skipping", layers=2, residual=True, zeroing_threshold=0.1))
    after, modified = lower(proto)
    assert modified
    assert sum(op == (PLUGIN_DOMAIN, PLUGIN_NAME) for op in ops(after)) == 2
    assert not any(d == "ai.layerzero" for d, _ in ops(after))
    assert [o.name for o in after.graph.output] == [o.name for o in proto.graph.output]
    onnx.checker.check_model(after, full_check=True)


@pytest.mark.parametrize("missing", ["normalize", "top_k", "scoring", "activation", "zeroing_threshold"])
def test_an_attribute_left_out_means_what_the_reference_reads(moe_model, missing):
    # A node without an attribute means MoENode's default to every other reader (LowerMoE, the ORT custom op,
    # verification's model): the plugin gets that value, not its own default. Before: normalize was read with
    # default 1, so a node without it normalized under TensorRT and not in the reference (and a node without
    # top_k was refused).
    import onnxruntime as ort

    from layerzero.passes._moe_node import MoENode
    from layerzero.passes.lower_moe import LowerMoE
    from layerzero.plugins.reference import moe_reference

    proto = moe_model(attributes={"zeroing_threshold": 0.3} if missing == "zeroing_threshold" else None)
    moe = next(n for n in proto.graph.node if n.op_type == "MoE")
    kept = [a for a in moe.attribute if a.name != missing]
    del moe.attribute[:]
    moe.attribute.extend(kept)
    view = MoENode.of(next(n for n in ir.from_proto(proto).graph if n.op_type == "MoE"))
    after, _ = lower(proto)
    fields = attrs(next(n for n in after.graph.node if n.op_type == PLUGIN_NAME))
    plugin = {k: v.decode() if isinstance(v, bytes) else v for k, v in fields.items() if k in PLUGIN_FIELDS}
    assert plugin == {k: getattr(view, k) for k in PLUGIN_FIELDS}

    # Numerically: the plugin's computation (the reference with the plugin's fields) is the ONNX Runtime model
    # verification runs (LowerMoE of the same node).
    model = ir.from_proto(proto)
    infer_shapes(model)
    LowerMoE("if")(model)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    hidden = np.random.default_rng(7).standard_normal((9, 16)).astype(np.float32)
    y, mask = session.run(["y", MASK], {"hidden": hidden})
    logits = hidden @ weights["router"].T
    y_ref, mask_ref = moe_reference(hidden, logits, weights["w_gate"], weights["w_up"], weights["w_down"], **plugin)
    np.testing.assert_array_equal(mask, mask_ref)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
