"""The TensorRT target and backend where TensorRT is missing (clear errors, nothing written), plus everything
of them that runs without it: profile parsing, the ONNX Runtime view of a --target tensorrt compile, lowering."""

from __future__ import annotations

import sys

import onnx
import onnx_ir as ir
import pytest

from layerzero.cli import main
from layerzero.compile import compile_file, compile_model
from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.options import CompileOptions
from layerzero.runtime import Engine, get_backend, write_bundle
from layerzero.runtime.backends.tensorrt import TensorRTBackend, TensorRTUnavailableError, _find_plan
from layerzero.targets.tensorrt import (
    TensorRTOptions,
    lower_for_tensorrt,
    ort_equivalent,
    parse_profile_shapes,
)


@pytest.fixture
def no_tensorrt(monkeypatch):
    """``import tensorrt`` fails, whether or not it is installed."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)


@pytest.fixture
def moe_onnx(tmp_path):
    """An exporter-style MoE model (batched_mm form) that the dynamic MoE pass turns into the skipping form."""
    moe = pytest.importorskip("layerzero.models.moe")
    path = tmp_path / "moe.onnx"
    onnx.save(moe.build_moe(moe.MoEConfig(hidden=16, ffn=32, experts=4, top_k=2)), path)
    return path


def test_backend_is_registered():
    assert get_backend("tensorrt") is TensorRTBackend
    assert get_backend("trt") is TensorRTBackend


def test_backend_without_tensorrt_says_what_to_install(no_tensorrt, tmp_path):
    with pytest.raises(TensorRTUnavailableError, match="pip install tensorrt-cu12") as info:
        TensorRTBackend().load(tmp_path / "model.onnx")
    assert info.value.exit_code == 2
    assert isinstance(info.value, LayerZeroError)


def test_backend_rejects_unknown_options_first(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown tensorrt backend option"):
        TensorRTBackend().load(tmp_path / "model.onnx", precision="fp16")


def test_engine_load_of_a_tensorrt_bundle_without_tensorrt(no_tensorrt, tmp_path, moe_model):
    lowered, _ = lower_for_tensorrt(ir.from_proto(moe_model(tokens=8)))
    bundle = write_bundle(tmp_path / "m.lz", lowered, {"target": "tensorrt"})
    (bundle / "model.plan").write_bytes(b"not a plan")
    with pytest.raises(TensorRTUnavailableError, match="TensorRT is not available"):
        Engine.load(bundle, backend="tensorrt")
    with pytest.raises(TensorRTUnavailableError, match="TensorRT is not available"):
        Engine.load(bundle)  # the manifest's target picks the tensorrt backend
    with pytest.raises(InvalidInputError, match="backend='tensorrt'"):
        Engine.load(bundle, backend="onnxruntime")  # the onnxruntime backend refuses a tensorrt bundle


def test_plan_lookup(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="--target tensorrt"):
        _find_plan(tmp_path / "model.onnx")
    (tmp_path / "model.plan").write_bytes(b"x")
    assert _find_plan(tmp_path / "model.onnx") == tmp_path / "model.plan"
    assert _find_plan(tmp_path / "other.engine") == tmp_path / "other.engine"


def test_compile_file_fails_before_any_work_and_writes_nothing(no_tensorrt, moe_onnx, tmp_path):
    out = tmp_path / "out.lz"
    with pytest.raises(TensorRTUnavailableError):
        compile_file(moe_onnx, out, CompileOptions(target="tensorrt"))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.onnx"]


def test_cli_compile_target_tensorrt_without_tensorrt_exits_2(no_tensorrt, moe_onnx, tmp_path, capsys):
    out = tmp_path / "out.lz"
    code = main(["compile", str(moe_onnx), "-o", str(out), "--target", "tensorrt", "--shape", "hidden:1,16/8,16/64,16"])
    assert code == 2
    err = capsys.readouterr().err
    assert "TensorRT is not available" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_profile_shapes_need_the_tensorrt_target(moe_onnx, tmp_path, capsys):
    code = main(["compile", str(moe_onnx), "-o", str(tmp_path / "o.lz"), "--shape", "hidden:1,16/8,16/64,16"])
    assert code == 2
    assert "for --target tensorrt" in capsys.readouterr().err


def test_parse_profile_shapes():
    assert parse_profile_shapes(["x:1,64/8,64/64,64", "mask:4,4"]) == {
        "x": ((1, 64), (8, 64), (64, 64)),
        "mask": ((4, 4), (4, 4), (4, 4)),
    }
    assert parse_profile_shapes(["scope/name:2/3/4"]) == {"scope/name": ((2,), (3,), (4,))}
    assert parse_profile_shapes(None) == {}
    for bad, message in [
        ("x", "expected NAME:MIN/OPT/MAX"),
        ("x:1/2", "one shape or three"),
        ("x:1,a/2,2/3,3", "integers"),
        ("x:1,2/2/3,3", "same rank"),
        ("x:4,64/2,64/8,64", "MIN <= OPT <= MAX"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            parse_profile_shapes([bad])


def test_precision_is_checked():
    assert TensorRTOptions(precision="bf16").to_dict()["precision"] == "bf16"
    with pytest.raises(InvalidInputError, match="precision 'int8'"):
        TensorRTOptions(precision="int8")


def test_compile_for_tensorrt_keeps_the_skipping_form_and_verifies_its_ort_lowering():
    moe = pytest.importorskip("layerzero.models.moe")
    source = moe.build_moe(moe.MoEConfig(layers=2, residual=True))
    # The `if` lowering pinned for the verified copy (auto keeps ai.layerzero::MoE where liblayerzero_ort.so is built).
    options = CompileOptions(target="tensorrt", shapes={"hidden": (8, 64)}, moe_lowering="if")
    result = compile_model(source, options)
    assert result.verification is not None and result.verification.passed
    domains = {(n.domain, n.op_type) for n in result.model.graph}
    assert ("ai.layerzero", "MoE") in domains  # left for the plugin
    checked = ort_equivalent(result.model, result.options)
    assert not any(n.domain == "ai.layerzero" for n in checked.graph.all_nodes())
    assert any(n.domain == "ai.layerzero" for n in result.model.graph)  # the view is a copy
    lowered, count = lower_for_tensorrt(result.model)
    assert count == 2
    assert sum(n.op_type == "LayerZeroMoE" and n.domain == "trt.plugins" for n in lowered.graph) == 2
    onnx.checker.check_model(ir.to_proto(lowered), full_check=True)


@pytest.fixture
def fake_builder(monkeypatch):
    """TensorRT replaced by a stub whose 'plan' is a byte string: exercises lowering and bundle writing."""
    import types

    from layerzero.targets import tensorrt as target

    calls = {}

    def build_engine(onnx_path, options, shapes):
        calls["onnx"] = onnx.load(str(onnx_path))
        calls["shapes"] = dict(shapes)
        if options.precision == "bf16":
            raise LayerZeroError("TensorRT failed to build an engine (stub)")
        return b"PLAN:" + options.precision.encode()

    monkeypatch.setattr(target, "require_tensorrt", lambda: types.SimpleNamespace(__version__="10.99"))
    monkeypatch.setattr(target, "load_plugin_library", lambda trt, path, required=False: None)
    monkeypatch.setattr(target, "build_engine", build_engine)
    return calls


def test_tensorrt_bundle_holds_lowered_graph_plan_and_manifest(fake_builder, moe_onnx, tmp_path):
    import json

    out = tmp_path / "out.lz"
    trt_options = TensorRTOptions(precision="fp16", profiles={"hidden": ((1, 16), (8, 16), (64, 16))}, verify=False)
    compile_file(moe_onnx, out, CompileOptions(target="tensorrt", shapes={"hidden": (8, 16)}), tensorrt=trt_options)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx", "model.plan"]
    assert (out / "model.plan").read_bytes() == b"PLAN:fp16"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "tensorrt" and manifest["model_file"] == "model.onnx"
    section = manifest["tensorrt"]
    assert section["precision"] == "fp16" and section["plan_file"] == "model.plan"
    assert section["profiles"] == {"hidden": [[1, 16], [8, 16], [64, 16]]}
    assert section["tensorrt_version"] == "10.99" and section["plugin_nodes"] == 1
    built = fake_builder["onnx"]
    assert [n.op_type for n in built.graph.node if n.domain == "trt.plugins"] == ["LayerZeroMoE"]
    assert fake_builder["shapes"] == {"hidden": (8, 16)}
    assert onnx.load(str(out / "model.onnx")).graph.node  # the lowered graph, kept for rebuilding
    assert manifest["backend"] == "tensorrt"  # what Engine.load picks
    with pytest.raises(InvalidInputError, match="backend='tensorrt'"):
        Engine.load(out, backend="onnxruntime")


def test_failed_engine_build_writes_nothing(fake_builder, moe_onnx, tmp_path):
    out = tmp_path / "out.lz"
    with pytest.raises(LayerZeroError, match="stub"):
        compile_file(moe_onnx, out, CompileOptions(target="tensorrt"), tensorrt=TensorRTOptions(precision="bf16"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.onnx"]
