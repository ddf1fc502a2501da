"""``layerzero.ort_runner``: the one place ONNX Runtime sessions are made (backend, verification, chunks, folding)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.ort_runner import create_session, providers_for
from layerzero.verify import run_model


def _add_model(external_weight: bool = False) -> onnx.ModelProto:
    weight = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    if external_weight:
        weight = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[2, 3])
        weight.data_location = onnx.TensorProto.EXTERNAL
        weight.external_data.add(key="location", value="lent-placeholder")
    graph = oh.make_graph(
        [oh.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [weight],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def test_session_from_bytes_runs_on_cpu() -> None:
    session = create_session(_add_model().SerializeToString())
    assert session.get_providers() == ["CPUExecutionProvider"]
    x = np.ones((2, 3), np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, x + np.arange(6, dtype=np.float32).reshape(2, 3))


def test_lent_initializers_are_read_and_kept_alive() -> None:
    weight = np.full((2, 3), 7.0, np.float32)
    session = create_session(_add_model(external_weight=True).SerializeToString(), external_initializers={"w": weight})
    del weight  # the session holds the lent buffer
    (y,) = session.run(None, {"x": np.zeros((2, 3), np.float32)})
    np.testing.assert_array_equal(y, np.full((2, 3), 7.0, np.float32))


def test_load_failure_names_the_model() -> None:
    with pytest.raises(UnsupportedModelError, match=r"onnxruntime cannot load chunk 3: "):
        create_session(b"not an onnx model", label="chunk 3")


def test_missing_custom_op_library_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match=r"liblayerzero_missing\.so"):
        create_session(_add_model().SerializeToString(), libraries=["liblayerzero_missing.so"])


def test_cuda_without_onnxruntime_gpu_is_one_clear_line() -> None:
    with pytest.raises(InvalidInputError, match=r"onnxruntime-gpu") as info:
        providers_for("cuda", available=["CPUExecutionProvider"])
    assert "\n" not in str(info.value)
    assert providers_for("cuda:1", available=["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    with pytest.raises(InvalidInputError, match="'tpu' is not one of"):
        providers_for("tpu")


def test_bad_optimization_level_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="graph_optimization_level 'fastest'"):
        create_session(_add_model().SerializeToString(), graph_optimization_level="fastest")


def test_verification_runs_through_the_runtime_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from layerzero.runtime.backends import onnxruntime as backend_module

    loaded = []
    real = backend_module.OrtBackend.load

    def spying(self, model_path, **options):
        loaded.append(options)
        return real(self, model_path, **options)

    monkeypatch.setattr(backend_module.OrtBackend, "load", spying)
    names, outputs = run_model(_add_model().SerializeToString(), {"x": np.ones((2, 3), np.float32), "extra": 1})
    assert loaded == [{"device": "cpu"}]
    assert names == ["y"]
    np.testing.assert_array_equal(outputs[0], 1 + np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(InvalidInputError, match="failed to run the model on the sample inputs"):
        run_model(_add_model().SerializeToString(), {"x": np.ones((3, 3), np.float32)})
