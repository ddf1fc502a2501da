"""``collect_activations`` on a model whose weights are in external data (every export over 2 GB): the session is
made from a saved file, not from serialised bytes that name data files they cannot reach (ONNX Runtime refused
the bytes: "External data path ... escapes working directory"; ``compile --activation-sparsity`` failed on the
Llama-1B export)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from layerzero.activation_calibration import collect_activations
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.sparsify_activations import find_groups

K, N = 64, 32


def _model(tmp_path: Path) -> tuple[Path, np.ndarray]:
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"], name="/model/layers.0/mlp/act"),
         helper.make_node("MatMul", ["h", "w"], ["m"], name="/model/layers.0/mlp/down_proj/MatMul"),
         helper.make_node("Add", ["m", "b"], ["y"], name="/model/layers.0/mlp/down_proj/Add")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", N])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.arange(N, dtype=np.float32), "b")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "src" / "model.onnx"
    path.parent.mkdir()
    # Threshold 0: the small bias too (an external tensor ir.save would load into memory and release)
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path, w


def test_collected_from_a_model_with_external_data(tmp_path: Path, monkeypatch) -> None:
    path, w = _model(tmp_path)
    monkeypatch.chdir(tmp_path)  # not the model's folder: its data is named relative to the model file only
    model = ir.load(path)
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)
    InferShapes()(model)
    groups = find_groups(model)
    bias = model.graph.initializers["b"].const_value
    view = bias.numpy()  # a live view of the small tensor's memory map, as a pass holds one of a weight
    assert [g.x.name for g in groups] == ["h"]
    x = np.random.default_rng(1).standard_normal((5, K)).astype(np.float32)
    got = collect_activations(model, groups, [{"x": x}, {"x": x[:3]}])
    np.testing.assert_array_equal(got[groups[0].name], np.maximum(np.concatenate([x, x[:3]]), 0))
    assert [o.name for o in model.graph.outputs] == ["y"]  # the extra outputs are gone again
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), w)
    assert model.graph.initializers["b"].const_value is bias and view[3] == 3  # put back, still mapped


def test_impact_tolerance_measures_a_model_with_external_data(tmp_path: Path, monkeypatch) -> None:
    # compile --activation-sparsity --impact-tolerance's measure (output_deviation): its sessions are made from
    # bytes that name the data relative to the model's folder (ONNX Runtime refused them: "escapes working
    # directory"); the data folder is given to the session, no copy of the weights written.
    from layerzero.activation_calibration import output_deviation

    path, w = _model(tmp_path)
    monkeypatch.chdir(tmp_path)
    model = ir.load(path)
    InferShapes()(model)
    (group,) = find_groups(model)
    x = np.random.default_rng(1).standard_normal((5, K)).astype(np.float32)
    evaluate = output_deviation(model, [{"x": x}])
    assert evaluate({group.name: np.zeros(K, np.float32)}) == 0.0  # thresholds 0: the dense model
    h = np.maximum(x, 0)
    t = np.full(K, 0.5, np.float32)
    want = (np.where(h > t, h, 0) @ w + np.arange(N)) - (h @ w + np.arange(N))
    got = evaluate({group.name: t})
    assert abs(got - np.linalg.norm(want) / np.linalg.norm(h @ w + np.arange(N))) < 1e-5
