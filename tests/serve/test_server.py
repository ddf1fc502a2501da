"""`layerzero serve` against a real Triton server on 127.0.0.1: HTTP and gRPC outputs, the kill switch
under load, the control endpoints and /metrics."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from layerzero.models import example_feeds
from layerzero.runtime import Engine
from layerzero.runtime.server import pytriton_available

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not pytriton_available(), reason="PyTriton is not importable (pip install 'layerzero[serve]')"),
]

@pytest.fixture(scope="module")
def server(tiny_model: SimpleNamespace, net: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    args = ["--reference", str(tiny_model.source), "--sample-rate", "0.25", "--segment", "audit:sample_rate=1"]
    with net.serve(tiny_model.bundle, log, *args, "--instances", "2") as served:
        yield SimpleNamespace(
            http=served.http, grpc=served.grpc, control=served.control, log=log,
            engine=Engine.load(tiny_model.bundle), config=tiny_model.config,
        )  # fmt: skip
    assert served.process.returncode == 0, log.read_text()[-4000:]


def _infer(protocol: str, url: str, ids: np.ndarray, **kwargs: object) -> np.ndarray:
    if protocol == "http":
        import tritonclient.http as client_lib
    else:
        import tritonclient.grpc as client_lib
    client = client_lib.InferenceServerClient(url)
    try:
        tensor = client_lib.InferInput("input_ids", list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        return client.infer("layerzero", [tensor], **kwargs).as_numpy("logits")
    finally:
        client.close()


def _status(server: SimpleNamespace, net: SimpleNamespace) -> dict:
    code, body = net.http("GET", f"{server.control}/status")
    assert code == 200
    return json.loads(body)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_match_engine_run(server: SimpleNamespace, protocol: str) -> None:
    for batch, seq in ((1, 4), (2, 9)):
        ids = example_feeds(server.config, batch=batch, seq=seq, seed=seq)["input_ids"]
        got = _infer(protocol, getattr(server, protocol), ids)
        want = server.engine.run({"input_ids": ids}).outputs["logits"]
        assert got.shape == want.shape == (batch, seq, server.config.vocab_size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_model_config_lists_engine_inputs_and_outputs(server: SimpleNamespace) -> None:
    import tritonclient.http as client_lib

    client = client_lib.InferenceServerClient(server.http)
    try:
        config = client.get_model_config("layerzero")
    finally:
        client.close()
    assert config["max_batch_size"] == 0
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("input_ids", "TYPE_INT64", [-1, -1])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("logits", "TYPE_FP32", [-1, -1, server.config.vocab_size])
    ]


def test_kill_switch_flips_under_load(server: SimpleNamespace, net: SimpleNamespace) -> None:
    ids = example_feeds(server.config, batch=1, seq=6, seed=3)["input_ids"]
    want = server.engine.run({"input_ids": ids}).outputs["logits"]  # the reference computes the same (consumed flags)
    before = _status(server, net)["guard"]
    errors: list[BaseException] = []
    done = [0] * 4
    deadline = time.monotonic() + 30

    def client(i: int) -> None:
        protocol = "http" if i % 2 else "grpc"
        try:
            for _ in range(30):
                if time.monotonic() > deadline:
                    return
                got = _infer(protocol, getattr(server, protocol), ids)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
                done[i] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while sum(done) < 20 and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.02)
    code, body = net.http("POST", f"{server.control}/kill-switch", {"on": True})
    assert (code, json.loads(body)) == (200, {"kill_switch": True})
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert sum(done) == 120

    after = _status(server, net)["guard"]
    assert after["kill_switch"] is True
    assert after["requests"] - before["requests"] == 120
    served_by_reference = after["reference_runs"]["kill_switch"] - before["reference_runs"]["kill_switch"]
    assert 0 < served_by_reference < 120
    code, metrics = net.http("GET", f"{server.control}/metrics")
    assert code == 200 and b"\nlayerzero_kill_switch 1.0\n" in metrics

    # After the flip, every request goes to the reference; after flipping back, none does.
    _infer("grpc", server.grpc, ids)
    assert _status(server, net)["guard"]["reference_runs"]["kill_switch"] == after["reference_runs"]["kill_switch"] + 1
    assert net.http("POST", f"{server.control}/kill-switch/off")[0] == 200
    runs = _status(server, net)["guard"]["reference_runs"]["kill_switch"]
    _infer("http", server.http, ids)
    guard = _status(server, net)["guard"]
    assert guard["kill_switch"] is False and guard["reference_runs"]["kill_switch"] == runs


def test_metrics_show_the_counters(server: SimpleNamespace, net: SimpleNamespace) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ids = example_feeds(server.config, batch=1, seq=5, seed=1)["input_ids"]
    for _ in range(3):
        _infer("http", server.http, ids, parameters={"segment": "audit"})
    code, text = net.http("GET", f"{server.control}/metrics")
    assert code == 200
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    status = _status(server, net)["guard"]
    requests = sum(v for (name, _), v in samples.items() if name == "layerzero_requests_total")
    assert requests == status["requests"] > 0
    assert samples[("layerzero_requests_total", (("segment", "audit"),))] >= 3
    assert samples[("layerzero_reference_runs_total", (("reason", "sampled"),))] == status["reference_runs"]["sampled"]
    assert samples[("layerzero_reference_runs_total", (("reason", "sampled"),))] >= 3  # audit samples every request
    assert samples[("layerzero_fallbacks_total", (("segment", "audit"),))] == 0  # a healthy model
    assert samples[("layerzero_zeroed_params_ratio", ())] > 0.2
    assert ("layerzero_zeroing_threshold", (("segment", "default"),)) in samples
    latency = sum(v for (name, _), v in samples.items() if name == "layerzero_request_latency_seconds_count")
    assert latency == requests


def test_control_endpoints(server: SimpleNamespace, net: SimpleNamespace) -> None:
    control = server.control
    code, body = net.http("POST", f"{control}/threshold", {"value": 0.3, "segment": "audit"})
    assert code == 200 and json.loads(body)["threshold"] == 0.3
    assert _status(server, net)["guard"]["segments"]["audit"]["threshold"] == 0.3
    assert net.http("POST", f"{control}/threshold", {"value": "high"})[0] == 400
    assert net.http("POST", f"{control}/threshold", {"value": 0.1, "segment": "nope"})[0] == 400
    assert net.http("POST", f"{control}/kill-switch", {"on": "yes"})[0] == 400
    assert net.http("GET", f"{control}/nothing")[0] == 404
    status = _status(server, net)
    assert status["ready"] and status["model"] == "layerzero"
    assert status["endpoints"]["grpc"] == server.grpc

    from tritonclient.utils import InferenceServerException

    ids = example_feeds(server.config, seq=3)["input_ids"]
    with pytest.raises(InferenceServerException, match="unknown segment 'nope'"):
        _infer("grpc", server.grpc, ids, parameters={"segment": "nope"})
    with pytest.raises(InferenceServerException):
        _infer("http", server.http, ids.astype(np.int32).astype(np.int64)[:, :, None])  # wrong rank


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a server started with ``start_new_session=True`` leads its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[-1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux) to list the server's processes")
def test_no_grpc_cli_serves_http_only_and_sigterm_leaves_no_process(tiny_model: SimpleNamespace,
                                                                     net: SimpleNamespace, tmp_path: Path) -> None:
    """`layerzero serve --no-grpc`: HTTP serves, the gRPC port is never opened, /status lists no gRPC endpoint;
    SIGTERM stops it with exit 0 and nothing of it (front, Triton, stubs) left running."""
    import socket

    log = tmp_path / "serve.log"
    args = ["--no-grpc", "--no-standby", "--no-reference", "--no-generate"]
    with net.serve(tiny_model.bundle, log, *args) as served:
        process, control, grpc_port = served.process, served.control, int(served.grpc.rsplit(":", 1)[1])
        config = tiny_model.config
        ids = example_feeds(config, batch=1, seq=5, seed=1)["input_ids"]
        got = _infer("http", served.http, ids)
        np.testing.assert_allclose(got, Engine.load(tiny_model.bundle).run({"input_ids": ids}).outputs["logits"],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", grpc_port), timeout=5):
            pass
        code, body = net.http("GET", f"{control}/status")
        status = json.loads(body)
        assert code == 200 and "grpc" not in status["endpoints"] and status["front"]["pid"] in _session(process.pid)
        assert len(_session(process.pid)) >= 3  # the server, its front, Triton (and its stubs)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()[-4000:]
        deadline = time.monotonic() + 10  # the kernel reaps orphans (stubs) a moment later
        while _session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _session(process.pid), _session(process.pid)


def test_triton_cpu_start_lines_are_not_shown_as_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20: `layerzero serve` on a CPU machine printed tritonserver's "E... CudaDriverHelper has not been
    initialized." (and the pinned-memory warning) as if something failed; they are harmless there and left
    out, every other line printed as PyTriton prints it."""
    if not pytriton_available():
        pytest.skip("PyTriton is not importable (pip install 'layerzero[serve]')")
    from pytriton.server.triton_server import TritonServer

    from layerzero.runtime.triton_process import patch_pytriton

    patch_pytriton()
    server = TritonServer.__new__(TritonServer)  # only its log recording
    server._verbose, server._tritonserver_logs = True, ""
    lines = [
        'W1201 14:14:21.712526 22652 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned '
        'memory pool will not be available: CUDA driver version is insufficient for CUDA runtime version"\n',
        'I1201 14:14:21.712693 22652 cuda_memory_manager.cc:117] "CUDA memory pool disabled"\n',
        b'E1201 14:14:21.712801 22652 server.cc:241] "CudaDriverHelper has not been initialized."\n',
        'I1201 14:14:22.497340 22652 http_server.cc:4713] "Started HTTPService at 127.0.0.1:57219"\n',
        'E1201 14:14:23.000000 22652 pb_stub.cc:714] "Failed to process the request(s) for model"\n',
    ]
    text = "".join(line.decode() if isinstance(line, bytes) else line for line in lines)
    for at in range(0, len(text), 37):  # PyTriton reads unbuffered: lines come in pieces
        server._record_logs(text[at : at + 37].encode() if at % 2 else text[at : at + 37])
    out = capsys.readouterr().out
    assert "CudaDriverHelper" not in out and "pinned memory" not in out and "CUDA memory pool" not in out
    assert "Started HTTPService" in out and "Failed to process the request(s)" in out  # a real error is shown
