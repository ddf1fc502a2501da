"""`layerzero triton-export`: the repository's config.pbtxt files parse as Triton ModelConfig and match the model;
the Python-backend model runs (with a stand-in pb_utils, and in a real tritonserver when PyTriton ships one)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import onnx
import onnx.parser
import pytest

from layerzero.cli import main
from layerzero.compile import compile_file
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions
from layerzero.runtime import MASK_PREFIX, Engine, write_bundle
from layerzero.runtime.server import pytriton_available
from layerzero.runtime.triton_repo import default_reference, export_triton_repository, make_triton_python_model

MASK = f"{MASK_PREFIX}layers.0.experts"
GROUP = f"{MASK_PREFIX}group.a"
ROUTER = "layerzero::router::layers.0"


@pytest.fixture(scope="module")
def masked_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """y = 2x (float[batch, n]), ids echoed (int64[batch]), a [batch, n, 2] expert mask, a scalar group mask and
    a router confidence output."""
    model = onnx.parser.parse_model(
        f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, n] x, int64[batch] ids) => (float[batch, n] y, int64[batch] ids_out,
                                                   bool[batch, n, 2] "{MASK}", bool "{GROUP}",
                                                   float[batch, n] "{ROUTER}") {{
            two = Constant<value = float {{2.0}}>()
            y = Mul(x, two)
            ids_out = Identity(ids)
            axes = Constant<value = int64[1] {{2}}>()
            e = Unsqueeze(x, axes)
            ee = Concat<axis = 2>(e, e)
            zero = Constant<value = float {{0.0}}>()
            "{MASK}" = Greater(ee, zero)
            "{GROUP}" = Constant<value = bool {{1}}>()
            "{ROUTER}" = Sigmoid(x)
        }}"""
    )
    onnx.checker.check_model(model, full_check=True)
    return write_bundle(tmp_path_factory.mktemp("masked") / "masked.lz", model, {"target": "onnxruntime"})


def _parse(path: Path):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient[grpc]")
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _io(entries) -> list[tuple]:
    from tritonclient.grpc import model_config_pb2

    return [(e.name, model_config_pb2.DataType.Name(e.data_type), list(e.dims), e.HasField("reshape")) for e in entries]


def test_configs_parse_and_match_the_model(masked_bundle: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "other").mkdir(parents=True)  # models already in the repository stay
    written = export_triton_repository(masked_bundle, repo, no_reference=True, instances=2)
    assert written == [repo / "layerzero", repo / "layerzero_onnx"]
    assert (repo / "other").is_dir()

    python = _parse(repo / "layerzero" / "config.pbtxt")
    assert (python.name, python.backend, python.platform, python.max_batch_size) == ("layerzero", "python", "", 0)
    assert _io(python.input) == [("x", "TYPE_FP32", [-1, -1], False), ("ids", "TYPE_INT64", [-1], False)]
    # (a) strips the skip masks and router outputs: the runtime turns them into the report.
    assert _io(python.output) == [("y", "TYPE_FP32", [-1, -1], False), ("ids_out", "TYPE_INT64", [-1], False)]
    assert python.instance_group[0].count == 2
    guard = json.loads(python.parameters["layerzero.guard"].string_value)
    assert guard["sample_rate"] == 0.0  # no reference: the guard is off
    assert "layerzero.reference" not in python.parameters

    ort_model = _parse(repo / "layerzero_onnx" / "config.pbtxt")
    assert (ort_model.name, ort_model.platform, ort_model.backend) == ("layerzero_onnx", "onnxruntime_onnx", "")
    assert ort_model.max_batch_size == 0
    assert _io(ort_model.input) == _io(python.input)
    # (b) serves the compiled graph as is: every output, masks included; a scalar is dims [1] + reshape [].
    assert _io(ort_model.output) == [
        ("y", "TYPE_FP32", [-1, -1], False),
        ("ids_out", "TYPE_INT64", [-1], False),
        (MASK, "TYPE_BOOL", [-1, -1, 2], False),
        (GROUP, "TYPE_BOOL", [1], True),
        (ROUTER, "TYPE_FP32", [-1, -1], False),
    ]
    assert list(ort_model.output[3].reshape.shape) == []

    version = repo / "layerzero" / "1"
    compile(version.joinpath("model.py").read_text(), "model.py", "exec")
    assert Engine.load(version / "model.lz").output_names == ["y", "ids_out"]
    assert (repo / "layerzero_onnx" / "1" / "model.onnx").read_bytes() == (masked_bundle / "model.onnx").read_bytes()
    assert not [p for p in repo.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_transformer_export_copies_the_reference_with_its_external_data(tmp_path: Path) -> None:
    config = TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64, flag_form="consumed", zero_blocks=(1,))
    source = tmp_path / "src" / "model.onnx"
    source.parent.mkdir()
    onnx.save(build_transformer(config), str(source), save_as_external_data=True, location="weights.bin",
              size_threshold=0)  # fmt: skip
    bundle = tmp_path / "model.lz"
    compile_file(source, bundle, CompileOptions(dynamic=False))
    assert default_reference(Engine.load(bundle).manifest) == source.resolve()

    repo = tmp_path / "repo"
    assert main(["triton-export", str(bundle), str(repo), "--sample-rate", "0.5", "--max-tokens", "64"]) == 0
    python = _parse(repo / "layerzero" / "config.pbtxt")
    assert _io(python.input) == [("input_ids", "TYPE_INT64", [-1, -1], False)]
    assert _io(python.output) == [("logits", "TYPE_FP32", [-1, -1, config.vocab_size], False)]
    guard = json.loads(python.parameters["layerzero.guard"].string_value)
    assert (guard["sample_rate"], guard["max_tokens"]) == (0.5, 64)
    reference = repo / "layerzero" / "1" / python.parameters["layerzero.reference"].string_value
    assert (reference.parent / "weights.bin").is_file()
    feeds = example_feeds(config, seq=4)
    np.testing.assert_allclose(
        Engine.load(reference).run(feeds).outputs["logits"], Engine.load(bundle).run(feeds).outputs["logits"],
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip

    assert main(["triton-export", str(bundle), str(repo)]) == 2  # exists
    assert main(["triton-export", str(bundle), str(repo), "--force", "--no-reference"]) == 0
    assert not (repo / "layerzero" / "1" / "reference").exists()


def test_default_reference_refuses_a_source_with_declared_flags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "declared.onnx"
    onnx.save(build_transformer(TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64, zero_blocks=(1,))),
              str(source))  # fmt: skip
    compile_file(source, tmp_path / "declared.lz", CompileOptions(dynamic=False))
    with caplog.at_level(logging.WARNING):
        assert default_reference(Engine.load(tmp_path / "declared.lz").manifest) is None
    assert "declared zero-flag layer(s) layers.1" in caplog.text
    manifest = {"source": {"path": str(source), "sha256": "0" * 64}}
    assert default_reference(manifest) is None  # changed since compiled


# ------------------------------------------------------------------------- the Python-backend model itself


class _FakePbUtils:
    """What model.py uses of triton_python_backend_utils."""

    class Tensor:
        def __init__(self, name: str, array: np.ndarray) -> None:
            self.name, self.array = name, array

        def as_numpy(self) -> np.ndarray:
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors: list, error: object = None) -> None:
            self.output_tensors, self.error = output_tensors, error

    class TritonError:
        def __init__(self, message: str) -> None:
            self.message = message

    class MetricFamily:
        COUNTER, GAUGE = "counter", "gauge"
        values: ClassVar[dict[str, float]] = {}

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict) -> object:
            family = self

            class _Metric:
                def increment(self, v: float) -> None:
                    _FakePbUtils.MetricFamily.values[family.name] = (
                        _FakePbUtils.MetricFamily.values.get(family.name, 0) + v
                    )

                def set(self, v: float) -> None:
                    _FakePbUtils.MetricFamily.values[family.name] = v

            return _Metric()

    @staticmethod
    def get_input_tensor_by_name(request: SimpleNamespace, name: str):
        value = request.inputs.get(name)
        return None if value is None else _FakePbUtils.Tensor(name, value)


def _request(params: dict | None = None, **inputs: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(inputs=inputs, parameters=lambda: json.dumps(params or {}))


def test_python_backend_model_runs_the_guarded_runtime(masked_bundle: Path, tmp_path: Path) -> None:
    reference = tmp_path / "ref.onnx"
    model = onnx.load(str(masked_bundle / "model.onnx"))
    onnx.save(model, str(reference))  # the compiled graph is its own exact reference here
    repo = tmp_path / "repo"
    export_triton_repository(masked_bundle, repo, reference=reference)
    config = _parse(repo / "layerzero" / "config.pbtxt")
    from google.protobuf import json_format

    _FakePbUtils.MetricFamily.values = {}
    backend = make_triton_python_model(_FakePbUtils)()
    backend.initialize({
        "model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
        "model_repository": str(repo / "layerzero"), "model_version": "1", "model_name": "layerzero",
    })  # fmt: skip
    x = np.array([[1.0, -2.0, 3.0]], np.float32)
    ids = np.array([7], np.int64)
    [response] = backend.execute([_request(x=x, ids=ids)])
    assert response.error is None
    assert [t.name for t in response.output_tensors] == ["y", "ids_out"]
    np.testing.assert_array_equal(response.output_tensors[0].array, 2 * x)
    np.testing.assert_array_equal(response.output_tensors[1].array, ids)

    (repo / "layerzero" / "1" / "control.json").write_text(json.dumps({"kill_switch": True}))
    backend.execute([_request(x=x, ids=ids)])
    assert backend.guard.kill_switch and backend.guard.stats()["reference_runs"]["kill_switch"] == 1
    [bad] = backend.execute([_request({"segment": "nope"}, x=x, ids=ids)])
    assert "unknown segment 'nope'" in bad.error.message
    [missing] = backend.execute([_request(x=x)])
    assert "missing input 'ids'" in missing.error.message
    values = _FakePbUtils.MetricFamily.values
    assert values["layerzero_requests_total"] == 2
    assert values["layerzero_reference_runs_total"] == 1
    assert values["layerzero_request_errors_total"] == 2
    assert values["layerzero_kill_switch"] == 1


# ----------------------------------------------------------------------------- in a real Triton server


@pytest.mark.serve
@pytest.mark.skipif(not pytriton_available(), reason="PyTriton is not importable (pip install 'layerzero[serve]')")
def test_python_backend_model_in_a_real_tritonserver(tiny_model: SimpleNamespace, net: SimpleNamespace,
                                                      tmp_path: Path) -> None:  # fmt: skip
    """PyTriton ships tritonserver with the Python backend (not the onnxruntime one): load model (a) in it."""
    import sysconfig

    import tritonclient.http as client_lib
    from pytriton.triton import TRITONSERVER_DIST_DIR
    from pytriton.utils.distribution import get_libs_path, get_stub_path

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    backends = tmp_path / "backends" / "python"
    backends.mkdir(parents=True)
    for item in Path(TRITONSERVER_DIST_DIR, "backends", "python").iterdir():
        if item.is_file():
            os.symlink(item, backends / item.name)
    shutil.copy(get_stub_path(version), backends / "triton_python_backend_stub")
    repo = tmp_path / "repo"
    export_triton_repository(tiny_model.bundle, repo, reference=tiny_model.source)
    shutil.rmtree(repo / "layerzero_onnx")  # no onnxruntime backend in PyTriton's build

    http_port, grpc_port, metrics_port = net.free_ports(3)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the stub's Python env
    import pytriton

    wheel_libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"  # libcudart, ...
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p
        for p in (str(get_libs_path()), str(wheel_libs), sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH"))
        if p
    )
    command = [
        str(Path(TRITONSERVER_DIST_DIR, "bin", "tritonserver")), "--model-repository", str(repo),
        "--backend-directory", str(tmp_path / "backends"), "--http-address", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--allow-metrics", "true", "--allow-gpu-metrics", "false",
        "--exit-timeout-secs", "3", "--strict-model-config", "true",
    ]  # fmt: skip
    log = tmp_path / "tritonserver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        ready = f"http://127.0.0.1:{http_port}/v2/models/layerzero/ready"
        while not (_port_open(http_port) and net.http("GET", ready, timeout=1)[0] == 200):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tritonserver did not serve the model:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        ids = example_feeds(tiny_model.config, batch=1, seq=5)["input_ids"]
        client = client_lib.InferenceServerClient(f"127.0.0.1:{http_port}")
        try:
            tensor = client_lib.InferInput("input_ids", list(ids.shape), "INT64")
            tensor.set_data_from_numpy(ids)
            got = client.infer("layerzero", [tensor]).as_numpy("logits")
        finally:
            client.close()
        want = Engine.load(tiny_model.bundle).run({"input_ids": ids}).outputs["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        code, metrics = net.http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
        assert code == 200 and b'layerzero_requests_total{model="layerzero"} 1' in metrics
    finally:
        net.stop(process, signal.SIGINT)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
