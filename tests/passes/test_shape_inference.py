"""``InferShapes``: onnx's public shape inference on a header-sized proto, merged back with whole types."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.passes import InferShapes

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def _matmul_model(helpers) -> ir.Model:
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 64] x, float[64, 32] w) => (y) <int64[2] s = {-1, 16}> {
            t = MatMul(x, w)
            y = Reshape(t, s)
        }
        """
    )
    weight = model.graph.inputs.pop(1)  # an 8 KB weight: too big to write in ONNX text
    weight.const_value = ir.tensor(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000, name="w")
    model.graph.register_initializer(weight)
    return model


def test_shapes_are_inferred_and_merged(helpers) -> None:
    model = _matmul_model(helpers)
    (y,) = model.graph.outputs
    assert y.shape is None
    assert InferShapes()(model).modified
    assert y.dtype == ir.DataType.FLOAT and y.shape is not None and y.shape[1] == 16  # data propagation read s
    t = model.graph.node(0).outputs[0]
    assert t.shape is not None and t.shape[1] == 32
    assert not InferShapes()(model).modified  # idempotent


def test_big_weights_are_not_serialised_and_come_back(helpers, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _matmul_model(helpers)
    weight = model.graph.initializers["w"]
    tensor = weight.const_value
    seen: list[onnx.ModelProto] = []
    real = onnx.shape_inference.infer_shapes

    def spying(proto, *args, **kwargs):
        seen.append(proto)
        return real(proto, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spying)
    InferShapes()(model)
    (proto,) = seen
    by_name = {t.name: t for t in proto.graph.initializer}
    assert by_name["w"].data_location == onnx.TensorProto.EXTERNAL and not by_name["w"].raw_data
    assert by_name["s"].data_location == onnx.TensorProto.DEFAULT  # small shape constants stay inline
    assert weight.const_value is tensor  # the model's own tensor is back
    x = np.ones((2, 64), np.float32)
    (y,) = helpers.run_ort(model, {"x": x}).values()
    np.testing.assert_allclose(y, (x @ tensor.numpy()).reshape(-1, 16), rtol=1e-6)


def test_weights_come_back_when_inference_fails(helpers, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _matmul_model(helpers)
    tensor = model.graph.initializers["w"].const_value

    def failing(*_args, **_kwargs):
        raise onnx.shape_inference.InferenceError("boom")

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", failing)
    assert not InferShapes()(model).modified  # Case 3
    assert model.graph.initializers["w"].const_value is tensor


def test_sequence_types_are_taken_whole(helpers) -> None:
    # Case 1: a sequence stays a sequence (onnx-ir's ShapeInferencePass would make it a tensor, which ORT refuses).
    model = helpers.parse(
        HEADER
        + """
        g (float[2, 3] x) => (float[2, 3] y) {
            zero = Constant<value = int64 {0}>()
            seq = SequenceConstruct(x, x)
            y = SequenceAt(seq, zero)
        }
        """
    )
    InferShapes()(model)
    seq = next(n for n in model.graph if n.op_type == "SequenceConstruct").outputs[0]
    assert isinstance(seq.type, ir.SequenceType)
    np.testing.assert_array_equal(
        helpers.run_ort(model, {"x": np.ones((2, 3), np.float32)})["y"], np.ones((2, 3), np.float32)
    )


def test_prelu_that_onnxruntime_broadcasts_has_no_shape_nor_its_consumers(helpers) -> None:
    # Case 4 (fuzz seed 108743): onnx infers PRelu's output shape as X's; ONNX Runtime broadcasts X with the slope
    # both ways (PRelu(x[], slope[1]) is [1]). That shape, and every shape computed from it, is unknown.
    model = helpers.parse(
        HEADER
        + """
        g (float x, float[N] z, float[1, 4] a) => (y, v) <float[1] s = {0}> {
            p = PRelu(x, s)
            m = Mul(p, z)
            y = Add(m, z)
            q = PRelu(a, s)
            v = Relu(q)
        }
        """
    )
    assert InferShapes()(model).modified
    shapes = {v.name: v.shape for v in ir.convenience.create_value_mapping(model.graph).values()}
    assert shapes["p"] is None and shapes["m"] is None and shapes["y"] is None
    assert shapes["q"] == ir.Shape([1, 4]) and shapes["v"] == ir.Shape([1, 4])  # slope [1] broadcasts to [1, 4]
    assert not InferShapes()(model).modified  # idempotent
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.array(2.0, np.float32), "z": np.ones(3, np.float32), "a": np.ones((1, 4), np.float32)}
    assert session.run(None, feeds)[0].shape == (3,)  # broadcast(p [1], z [3]): p is not [] as onnx infers


def test_shapes_run_through_onnxruntime_contrib_ops(helpers) -> None:
    """Case 5: a graph without value_info (what ONNX Runtime's quantizer or a hand-made graph writes) keeps its
    shapes past MatMulNBits, the skip norm and MoE, whose stand-ins onnx infers; the model is left as it was."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    codes = onnx.numpy_helper.from_array(np.zeros((96, 2, 16), np.uint8), "codes")
    scales = onnx.numpy_helper.from_array(np.ones(96 * 2, np.float32), "scales")
    gamma = onnx.numpy_helper.from_array(np.ones(64, np.float32), "gamma")
    nbits = {"K": 64, "N": 96, "bits": 4, "block_size": 32}
    nodes = [
        h.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["n", "", "", "sum"],
                    domain="com.microsoft", epsilon=1e-6),
        h.make_node("MatMulNBits", ["n", "codes", "scales"], ["a"], domain="com.microsoft", **nbits),
        h.make_node("MatMulNBits", ["sum", "codes", "scales"], ["b"], domain="com.microsoft", **nbits),
        h.make_node("Relu", ["a"], ["r"]),
        h.make_node("Add", ["r", "b"], ["y"]),
        h.make_node("MoE", ["y", "router", "experts"], ["z"], domain="com.microsoft", k=1),
    ]  # fmt: skip
    inputs = [h.make_tensor_value_info(name, f, ["B", "T", 64]) for name in ("x", "skip")]
    inputs += [h.make_tensor_value_info("router", f, ["B", "T", 4])]
    inputs += [h.make_tensor_value_info("experts", f, [4, 96, 96])]
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("z", f, None)], [codes, scales, gamma])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
    model = ir.from_proto(proto)
    before = [(n.op_type, n.domain) for n in model.graph]
    assert InferShapes()(model).modified
    values = {v.name: v for n in model.graph for v in n.outputs}
    for name, width in [("n", 64), ("sum", 64), ("a", 96), ("b", 96), ("r", 96), ("y", 96), ("z", 96)]:
        shape = values[name].shape
        assert shape is not None and [str(d) for d in shape] == ["B", "T", str(width)], (name, shape)
        assert values[name].dtype == ir.DataType.FLOAT
    assert [(n.op_type, n.domain) for n in model.graph] == before  # the stand-ins lived in the proto only
    assert set(model.graph.initializers) == {"codes", "scales", "gamma"}
    np.testing.assert_array_equal(model.graph.initializers["codes"].const_value.numpy(), np.zeros((96, 2, 16)))
