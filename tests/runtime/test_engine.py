"""Engine: runs like a direct ORT session, validates feeds by name, strips and reports skip masks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnxruntime as ort
import pytest

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime import MASK_PREFIX, Engine, Report, Result, TensorSpec, get_backend, write_bundle
from layerzero.runtime.backends.onnxruntime import OrtBackend

MANIFEST = {
    "target": "onnxruntime",
    "stats": {"nodes_before": 10, "nodes_after": 6, "params_before": 1000, "params_after": 769},
    "layers": {"total": 4, "zeroed": ["layers.1"]},
}


def _mlp() -> onnx.ModelProto:
    """y = relu(x @ w + b); x: float[batch, 4]; also an int64 input `ids` echoed as `ids_out`."""
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 4] x, int64[batch] ids) => (float[batch, 3] y, int64[batch] ids_out) {
            h = MatMul(x, w)
            z = Add(h, b)
            y = Relu(z)
            ids_out = Identity(ids)
        }
        """
    )
    rng = np.random.default_rng(0)
    model.graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
            onnx.numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b"),
        ]
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def _masked() -> onnx.ModelProto:
    """y = x * 2, plus two mask outputs: experts.0 (x > -inf: all true), experts.1 (x > inf: all false)."""
    m0, m1 = f"{MASK_PREFIX}layers.0.experts.0", f"{MASK_PREFIX}layers.0.experts.1"
    model = onnx.parser.parse_model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[tokens] x) => (float[tokens] y, bool[tokens] "{m0}", bool[tokens] "{m1}") {{
            two = Constant<value = float {{2.0}}>()
            lo = Constant<value = float {{-inf}}>()
            hi = Constant<value = float {{inf}}>()
            y = Mul(x, two)
            "{m0}" = Greater(x, lo)
            "{m1}" = Greater(x, hi)
        }}
        """
    )
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def mlp_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("mlp") / "mlp.lz", _mlp(), MANIFEST)


@pytest.fixture(scope="module")
def mlp(mlp_bundle: Path) -> Engine:
    return Engine.load(mlp_bundle, intra_op_num_threads=1)


def _feeds(batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32), "ids": np.arange(batch, dtype=np.int64)}


def test_run_matches_direct_ort_session(mlp: Engine, mlp_bundle: Path) -> None:
    feeds = _feeds(3)
    result = mlp.run(feeds)
    assert isinstance(result, Result)
    session = ort.InferenceSession(str(mlp_bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    assert list(result.outputs) == ["y", "ids_out"] == mlp.output_names
    np.testing.assert_array_equal(result.outputs["y"], expected[0])
    np.testing.assert_array_equal(result.outputs["ids_out"], expected[1])


def test_specs_and_static_report(mlp: Engine) -> None:
    assert mlp.input_specs == [
        TensorSpec("x", np.dtype(np.float32), ("batch", 4)),
        TensorSpec("ids", np.dtype(np.int64), ("batch",)),
    ]
    assert mlp.manifest["layers"]["zeroed"] == ["layers.1"]
    report = mlp.run(_feeds()).report
    assert report.total_layers == 4
    assert report.zeroed_layers == 1
    assert report.zeroed_paths == ["layers.1"]
    assert report.zeroed_params_ratio == pytest.approx(0.231)
    assert report.skipped_paths == []
    assert report.summary() == "zeroed 1/4 layers, 23.1% of parameters"
    template = mlp.report_template()
    template.zeroed_paths.append("mutated")
    assert mlp.report_template().zeroed_paths == ["layers.1"]


def test_python_lists_are_converted_when_lossless(mlp: Engine) -> None:
    x = [[0.5, -1.0, 2.0, 0.0]]
    result = mlp.run({"x": x, "ids": [7]})
    np.testing.assert_array_equal(result.outputs["ids_out"], np.array([7], dtype=np.int64))
    direct = mlp.run({"x": np.array(x, dtype=np.float32), "ids": np.array([7])})
    np.testing.assert_array_equal(result.outputs["y"], direct.outputs["y"])


@pytest.mark.parametrize(
    ("feeds", "pattern"),
    [
        ({**_feeds(), "z": np.zeros(1)}, r"unknown input 'z'.*'x'.*'ids'"),
        ({"x": _feeds()["x"]}, r"missing input 'ids' \(int64\[batch\]\)"),
        ({**_feeds(), "x": _feeds()["x"].astype(np.float64)}, r"input 'x': dtype is float64, .* expects float32"),
        ({**_feeds(), "ids": np.arange(2, dtype=np.int32)}, r"input 'ids': dtype is int32, .* expects int64"),
        ({**_feeds(), "x": np.zeros(4, np.float32)}, r"input 'x': rank is 1 .* expects rank 2"),
        ({**_feeds(), "x": np.zeros((2, 5), np.float32)}, r"input 'x': dim 1 is 5, the model expects 4"),
        ({**_feeds(), "ids": [0.5, 1.5]}, r"input 'ids': got list of float64 values, the model expects int64"),
        ({**_feeds(), "ids": [2**70, 1]}, r"input 'ids'"),
        ({**_feeds(), "x": [[1, 2], [3]]}, r"input 'x': cannot make an array"),
    ],
    ids=["unknown", "missing", "dtype", "int-dtype", "rank", "static-dim", "float-list", "int-overflow", "ragged"],
)
def test_feed_errors_name_the_input(mlp: Engine, feeds: dict, pattern: str) -> None:
    with pytest.raises(InvalidInputError, match=pattern) as info:
        mlp.run(feeds)
    assert "\n" not in str(info.value)


def test_non_mapping_feeds(mlp: Engine) -> None:
    with pytest.raises(InvalidInputError, match="mapping of input name"):
        mlp.run([_feeds()["x"]])  # type: ignore[arg-type]


def test_runtime_failure_is_reraised_with_first_line(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[n] x) => (float[2, 3] y) {
            shape = Constant<value = int64[2] {2, 3}>()
            y = Reshape(x, shape)
        }
        """
    )
    engine = Engine.load(write_bundle(tmp_path / "r.lz", model, {}))
    assert engine.run({"x": np.zeros(6, np.float32)}).outputs["y"].shape == (2, 3)
    with pytest.raises(LayerZeroError, match="onnxruntime failed to run") as info:
        engine.run({"x": np.zeros(5, np.float32)})
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, Exception)


def test_masks_are_stripped_and_reported(tmp_path: Path) -> None:
    engine = Engine.load(write_bundle(tmp_path / "moe.lz", _masked(), {}))
    assert engine.output_names == ["y"]
    assert engine.mask_paths == ["layers.0.experts.0", "layers.0.experts.1"]
    x = np.array([1.0, -2.0, 3.0], np.float32)

    result = engine.run({"x": x})
    assert list(result.outputs) == ["y"]
    np.testing.assert_array_equal(result.outputs["y"], x * 2)
    assert result.report.skipped_paths == ["layers.0.experts.1"]
    assert result.report.masks == {}
    assert "skipped 1 path on this request" in result.report.summary()

    with_masks = engine.run({"x": x}, masks=True).report
    assert sorted(with_masks.masks) == ["layers.0.experts.0", "layers.0.experts.1"]
    assert with_masks.masks["layers.0.experts.0"].all()
    assert not with_masks.masks["layers.0.experts.1"].any()
    # An empty request (no tokens) is no evidence that a path was skipped.
    assert engine.run({"x": np.zeros(0, np.float32)}).report.skipped_paths == []


def test_report_to_dict_is_json_serialisable(tmp_path: Path) -> None:
    engine = Engine.load(write_bundle(tmp_path / "moe.lz", _masked(), MANIFEST))
    report = engine.run({"x": np.ones(2, np.float32)}, masks=True).report
    report.routing_confidence = np.float32(0.75)  # type: ignore[assignment]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["masks"]["layers.0.experts.1"] == [False, False]
    assert data["skipped_paths"] == ["layers.0.experts.1"]
    assert data["zeroed_params_ratio"] == pytest.approx(0.231)
    assert data["routing_confidence"] == 0.75
    assert Report().summary() == "zeroed 0/0 layers, 0.0% of parameters"


def test_plain_onnx_file_runs_uncompiled(tmp_path: Path) -> None:
    path = tmp_path / "plain.onnx"
    onnx.save_model(_mlp(), path)
    engine = Engine.load(path)
    assert engine.manifest == {}
    report = engine.run(_feeds()).report
    assert (report.total_layers, report.zeroed_layers, report.zeroed_params_ratio) == (0, 0, 0.0)


def test_scalar_and_unknown_rank_inputs(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64 k, float anything) => (int64 k_out, float out) {
            k_out = Identity(k)
            out = Identity(anything)
        }
        """
    )
    model.graph.input[1].type.tensor_type.ClearField("shape")
    model.graph.output[1].type.tensor_type.ClearField("shape")
    engine = Engine.load(write_bundle(tmp_path / "s.lz", model, {}))
    assert [s.shape for s in engine.input_specs] == [(), None]
    result = engine.run({"k": 3, "anything": np.ones((2, 2, 2), np.float32)})
    assert result.outputs["k_out"] == 3
    with pytest.raises(InvalidInputError, match="input 'k': rank is 1"):
        engine.run({"k": [3], "anything": np.ones(1, np.float32)})


def test_backend_registry_and_options(mlp_bundle: Path) -> None:
    assert get_backend("onnxruntime") is OrtBackend
    assert get_backend("ort") is OrtBackend
    with pytest.raises(InvalidInputError, match=r"unknown backend 'tensorrtx'.*'onnxruntime'"):
        get_backend("tensorrtx")
    with pytest.raises(InvalidInputError, match="unknown backend 'nope'"):
        Engine.load(mlp_bundle, backend="nope")
    with pytest.raises(InvalidInputError, match=r"unknown onnxruntime backend option.*'threads'"):
        Engine.load(mlp_bundle, threads=2)
    with pytest.raises(InvalidInputError, match="graph_optimization_level 'fast'"):
        Engine.load(mlp_bundle, graph_optimization_level="fast")
    with pytest.raises(InvalidInputError, match="device 'tpu'"):
        Engine.load(mlp_bundle, device="tpu")
    engine = Engine.load(mlp_bundle, backend="ort", graph_optimization_level="basic")
    assert engine.backend.name == "onnxruntime"


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this onnxruntime has CUDA")
def test_cuda_without_onnxruntime_gpu(mlp_bundle: Path) -> None:
    with pytest.raises(InvalidInputError, match="onnxruntime-gpu"):
        Engine.load(mlp_bundle, device="cuda")


def test_bundle_for_another_target_is_refused(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "trt.lz", _mlp(), {**MANIFEST, "target": "tensorrt"})
    with pytest.raises(InvalidInputError, match=r"compiled for target 'tensorrt'.*backend='tensorrt'"):
        Engine.load(out, backend="onnxruntime")


def test_backend_comes_from_the_manifest(tmp_path: Path) -> None:
    # A registered fake backend named by the manifest's "backend" is the one Engine.load uses; "target" alone
    # (bundles written before the "backend" field) names it too; an explicit backend= wins.
    from layerzero.runtime.backends import base

    class Fake(OrtBackend):
        name = "fake"
        targets = ("fake-target",)

    base.register_backend("fake", Fake)
    try:
        named = write_bundle(tmp_path / "a.lz", _mlp(), {**MANIFEST, "target": "fake-target", "backend": "fake"})
        assert type(Engine.load(named).backend) is Fake
        old = write_bundle(tmp_path / "b.lz", _mlp(), {**MANIFEST, "target": "fake"})
        with pytest.raises(InvalidInputError, match="compiled for target 'fake'"):
            Engine.load(old)  # the "fake" backend runs target "fake-target" only
        with pytest.raises(InvalidInputError, match="compiled for target 'fake-target'"):
            Engine.load(named, backend="onnxruntime")
        assert type(Engine.load(tmp_path / "a.lz" / "model.onnx").backend) is OrtBackend
    finally:
        base._REGISTRY.pop("fake")


def test_profiling(mlp_bundle: Path, tmp_path: Path) -> None:
    engine = Engine.load(mlp_bundle, enable_profiling=True, profile_file_prefix=str(tmp_path / "prof"))
    engine.run(_feeds())
    profile = Path(engine.backend.end_profiling())
    assert profile.is_file()
    assert isinstance(json.loads(profile.read_text()), list)
    with pytest.raises(LayerZeroError, match="profiling is off"):
        engine.backend.end_profiling()


def test_importing_the_runtime_is_light() -> None:
    code = (
        "import sys, layerzero.runtime; "
        "heavy = [m for m in ('onnx', 'onnx_ir', 'onnxruntime', 'layerzero.compile') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
