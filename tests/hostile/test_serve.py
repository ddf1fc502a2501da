"""`layerzero serve` under hostile requests: every malformed inference or control request gets a 4xx with one
line (no traceback, no server path), is counted, and the server keeps serving valid requests correctly; a
killed Triton is restarted and the request waiting on it is answered."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from layerzero.errors import LayerZeroError
from layerzero.models import example_feeds
from layerzero.runtime import Engine
from layerzero.runtime.server import pytriton_available

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not pytriton_available(), reason="PyTriton is not importable (pip install 'layerzero[serve]')"),
]

MAX_BYTES = 1 << 20
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def served(tiny: SimpleNamespace, helpers: SimpleNamespace):
    from layerzero.runtime.guard import GuardConfig, GuardedEngine
    from layerzero.runtime.server import LayerZeroServer, ServerConfig

    http_port, grpc_port, control_port = helpers.free_ports(3)
    engine = Engine.load(tiny.bundle)
    guard = GuardedEngine(engine, tiny.source, GuardConfig(sample_rate=0.0))
    config = ServerConfig(http_port=http_port, grpc_port=grpc_port, control_port=control_port,
                          max_request_bytes=MAX_BYTES, client_timeout_s=TIMEOUT_S, restart_wait_s=240)  # fmt: skip
    server = LayerZeroServer(guard, config)
    try:
        server.start()
    except LayerZeroError as e:
        # PyTriton's stub handshake has a fixed 1 s timeout; on an overloaded machine it can miss all five tries.
        # That is the environment, not this server: skip (with the reason), never pass. Anything else fails.
        if "waiting for config file" in str(e) or "handshake" in str(e):
            pytest.skip(f"PyTriton could not start its Python-backend stubs on this loaded machine: {e}"[:300])
        raise
    try:
        yield SimpleNamespace(server=server, http=http_port, grpc=grpc_port, control=control_port, engine=engine,
                              config=tiny.config)  # fmt: skip
    finally:
        server.stop()


def raw(port: int, data: bytes, timeout: float = 30.0, wait_s: float = 0.0) -> tuple[int, bytes]:
    """Send ``data`` as is (then wait ``wait_s`` before reading); the status and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if wait_s:
            time.sleep(wait_s)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed without an answer: {buffer!r}")
            buffer += chunk
        head, _, body = buffer.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, body[:length]


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return raw(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def _request(ids: np.ndarray) -> dict:
    tensor = {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.ravel().tolist()}
    return {"inputs": [tensor]}


def _counters(served: SimpleNamespace) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = raw(served.control, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200
    values = {"layerzero_requests_total": 0.0, "layerzero_request_errors_total": 0.0}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name in values:
                values[s.name] += s.value
    return values["layerzero_requests_total"], values["layerzero_request_errors_total"]


def assert_one_line(status: int, body: bytes, *codes: int) -> None:
    assert status in codes, (status, body[:500])
    text = body.decode()
    assert text.count("\n") <= 1 and "Traceback" not in text and "/tmp/" not in text and "/work/" not in text, text
    assert json.loads(text)["error"]


def _bad_requests(ids: np.ndarray) -> list[tuple[str, bytes, dict[str, str], int]]:
    good = _request(ids)

    def variant(**changes: object) -> bytes:
        doc = json.loads(json.dumps(good))
        doc["inputs"][0].update(changes)
        return json.dumps(doc).encode()

    n = ids.size
    huge_dim = b'{"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, ' + b"9" * 300
    huge_dim += b'], "data": [1]}]}'
    binary = variant(parameters={"binary_data_size": 3}, data=None)
    return [
        ("huge shape", variant(shape=[1, 1_000_000_000, 16]), {}, 400),
        ("huge rank-2 shape", variant(shape=[1, 1_000_000_000]), {}, 400),
        ("300-digit dim", huge_dim, {}, 400),
        ("bool dims", variant(shape=[True, n]), {}, 400),
        ("negative dim", variant(shape=[-1, n]), {}, 400),
        ("empty sequence", variant(shape=[1, 0], data=[]), {}, 400),
        ("id out of range", variant(data=[10**6] * n), {}, 400),
        ("negative id", variant(data=[-1] * n), {}, 400),
        ("float ids", variant(data=[0.5] * n), {}, 400),
        ("wrong datatype", variant(datatype="FP32"), {}, 400),
        ("short data", variant(data=[1]), {}, 400),
        ("nested data too deep", variant(data=[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), {}, 400),
        ("unknown input", variant(name="nope"), {}, 400),
        ("missing input", b'{"inputs": []}', {}, 400),
        ("duplicate input", json.dumps({"inputs": good["inputs"] * 2}).encode(), {}, 400),
        ("not json", b"{nope", {}, 400),
        ("json list", b"[1, 2]", {}, 400),
        ("deep json", b"[" * 20000 + b"]" * 20000, {}, 400),
        ("segment list", json.dumps({**good, "parameters": {"segment": ["a"]}}).encode(), {}, 400),
        ("unknown segment", json.dumps({**good, "parameters": {"segment": "nope"}}).encode(), {}, 400),
        ("unknown output", json.dumps({**good, "outputs": [{"name": "secret"}]}).encode(), {}, 400),
        ("binary header past body", variant(), {"Inference-Header-Content-Length": "99999"}, 400),
        ("binary size mismatch", binary + b"abc", {"Inference-Header-Content-Length": str(len(binary))}, 400),
        ("gzip", variant(), {"Content-Encoding": "gzip"}, 415),
    ]


def test_malformed_inference_requests_get_4xx_and_are_counted(served: SimpleNamespace) -> None:
    ids = example_feeds(served.config, batch=1, seq=6, seed=2)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    requests_before, errors_before = _counters(served)
    cases = _bad_requests(ids)
    for name, body, headers, code in cases:
        status, answer = post(served.http, "/v2/models/layerzero/infer", body, headers)
        assert_one_line(status, answer, code)
        if name == "id out of range":
            assert b"out of range [0, " in answer
    wrong_model = post(served.http, "/v2/models/other/infer", json.dumps(_request(ids)).encode())
    assert_one_line(*wrong_model, 404)

    # The server still serves, correctly.
    status, answer = post(served.http, "/v2/models/layerzero/infer", json.dumps(_request(ids)).encode())
    assert status == 200, answer[:500]
    [output] = json.loads(answer)["outputs"]
    np.testing.assert_allclose(np.asarray(output["data"], np.float32).reshape(output["shape"]), want, atol=1e-5)
    requests_after, errors_after = _counters(served)
    assert requests_after - requests_before == 1
    assert errors_after - errors_before == len(cases) + 1


def test_broken_http_framing(served: SimpleNamespace) -> None:
    path = b"POST /v2/models/layerzero/infer HTTP/1.1\r\nHost: x\r\n"
    _, errors_before = _counters(served)
    assert_one_line(*raw(served.http, path + b"Content-Length: abc\r\n\r\n"), 400)
    assert_one_line(*raw(served.http, path + b"Content-Length: -1\r\n\r\n"), 400)
    assert_one_line(*raw(served.http, path + b"Content-Length: " + b"9" * 300 + b"\r\n\r\n"), 400, 413)
    assert_one_line(*raw(served.http, path + b"\r\n"), 411)
    assert_one_line(*raw(served.http, path + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), 411)
    assert_one_line(*raw(served.http, path + f"Content-Length: {100 << 20}\r\n\r\n".encode() + b"x" * 1000), 413)
    # A slow client (10 of 100 bytes, then nothing) is cut off after the client timeout, not held forever.
    started = time.monotonic()
    assert_one_line(*raw(served.http, path + b"Content-Length: 100\r\n\r\n" + b"x" * 10, timeout=30), 408)
    assert time.monotonic() - started < TIMEOUT_S + 10
    _, errors_after = _counters(served)
    assert errors_after - errors_before == 7
    status, _ = raw(served.http, b"PUT /v2/models/layerzero/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 405
    status, body = raw(served.http, b"GET /v2/models/layerzero HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and json.loads(body)["name"] == "layerzero"


def test_grpc_gets_the_same_checks(served: SimpleNamespace) -> None:
    import tritonclient.grpc as grpc_lib
    from tritonclient.utils import InferenceServerException

    _, errors_before = _counters(served)
    client = grpc_lib.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        ids = np.full((1, 3), 10**6, np.int64)
        tensor = grpc_lib.InferInput("input_ids", list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        with pytest.raises(InferenceServerException, match=r"\[layerzero 400\] input 'input_ids': id 1000000"):
            client.infer("layerzero", [tensor])
        # NOTE: gRPC reaches Triton directly (no front): an empty tensor fails in PyTriton's shared-memory copy
        # before the infer callable, so it is refused but not counted; the server survives it.
        empty = grpc_lib.InferInput("input_ids", [1, 0], "INT64")
        empty.set_data_from_numpy(np.zeros((1, 0), np.int64))
        with pytest.raises(InferenceServerException):
            client.infer("layerzero", [empty])
        ok = grpc_lib.InferInput("input_ids", [1, 3], "INT64")
        ok.set_data_from_numpy(np.ones((1, 3), np.int64))
        assert client.infer("layerzero", [ok]).as_numpy("logits").shape == (1, 3, served.config.vocab_size)
    finally:
        client.close()
    _, errors_after = _counters(served)
    assert errors_after - errors_before == 1


def test_control_server_answers_every_malformed_request(served: SimpleNamespace) -> None:
    port = served.control

    def control(body: bytes, path: str = "/threshold") -> tuple[int, bytes]:
        return post(port, path, body)

    assert_one_line(*control(b'{"value": 0.1, "segment": ["default"]}'), 400)
    assert_one_line(*control(b'{"value": ' + b"9" * 300 + b"}"), 400)
    assert_one_line(*control(b'{"value": NaN}'), 400)
    assert_one_line(*control(b'{"value": -1}'), 400)
    assert_one_line(*control(b'{"value": 0.1, "segment": "nope"}'), 400)
    assert_one_line(*control(b"[" * 20000), 400)
    assert_one_line(*control(b"[1]"), 400)
    assert_one_line(*control(b"\xff\xfe"), 400)
    assert_one_line(*control(b'{"on": "yes"}', "/kill-switch"), 400)
    assert_one_line(*control(b"{}", "/nothing"), 404)
    head = b"POST /threshold HTTP/1.1\r\nHost: x\r\n"
    assert_one_line(*raw(port, head + b"Content-Length: abc\r\n\r\n"), 400)
    assert_one_line(*raw(port, head + b"Content-Length: -1\r\n\r\n"), 400)
    assert_one_line(*raw(port, head + b"\r\n"), 411)
    assert_one_line(*raw(port, head + f"Content-Length: {100 << 20}\r\n\r\n".encode() + b"{" * 1000), 413)
    started = time.monotonic()
    assert_one_line(*raw(port, head + b"Content-Length: 50\r\n\r\n{", timeout=30), 408)
    assert time.monotonic() - started < TIMEOUT_S + 10
    assert raw(port, b"DELETE /threshold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")[0] == 405
    # ... and still works.
    status, body = control(b'{"value": 0.25}')
    assert status == 200 and json.loads(body)["threshold"] == 0.25
    assert raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == (200, b"ok\n")


def test_mixed_traffic_adds_up(served: SimpleNamespace) -> None:
    ids = example_feeds(served.config, batch=1, seq=5, seed=7)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    bad = [body for _, body, headers, _ in _bad_requests(ids) if not headers][:6]
    requests_before, errors_before = _counters(served)
    failures: list[str] = []
    sent_bad = [0] * 4

    def client(i: int) -> None:
        for j in range(20):
            if j % 5 == i % 5:
                status, answer = post(served.http, "/v2/models/layerzero/infer", bad[(i + j) % len(bad)])
                sent_bad[i] += 1
                if not 400 <= status < 500:
                    failures.append(f"malformed: {status} {answer[:200]!r}")
                continue
            status, answer = post(served.http, "/v2/models/layerzero/infer", json.dumps(_request(ids)).encode())
            if status != 200:
                failures.append(f"valid: {status} {answer[:200]!r}")
                continue
            [output] = json.loads(answer)["outputs"]
            if not np.allclose(np.asarray(output["data"], np.float32).reshape(output["shape"]), want, atol=1e-5):
                failures.append("valid: wrong answer")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures[:5]
    requests_after, errors_after = _counters(served)
    assert errors_after - errors_before == sum(sent_bad)
    assert requests_after - requests_before == 80 - sum(sent_bad)


def test_serve_refuses_bad_setups_before_starting(tiny: SimpleNamespace, helpers: SimpleNamespace,
                                                   tmp_path: os.PathLike) -> None:  # fmt: skip
    from pathlib import Path

    garbage = Path(tmp_path) / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    http_port, grpc_port, control_port = helpers.free_ports(3)
    ports = ["--port-http", str(http_port), "--port-grpc", str(grpc_port), "--port-metrics", str(control_port)]
    helpers.one_line(helpers.run_cli("serve", tiny.bundle, "--reference", garbage, *ports), "garbage.onnx")
    same = ["--port-http", str(http_port), "--port-grpc", str(http_port), "--port-metrics", str(control_port)]
    helpers.one_line(helpers.run_cli("serve", tiny.bundle, "--no-reference", *same), "must differ")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", http_port))
        busy.listen()
        helpers.one_line(helpers.run_cli("serve", tiny.bundle, "--no-reference", *ports), "--port-http")


def test_killed_triton_is_restarted_and_the_waiting_request_answered(served: SimpleNamespace) -> None:
    server = served.server
    ids = example_feeds(served.config, batch=1, seq=4, seed=9)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    pid, restarts = server.triton_pid, server.restarts
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    status, answer = post(served.http, "/v2/models/layerzero/infer", json.dumps(_request(ids)).encode())
    fatal = server._fatal or ""
    if status != 200 and ("handshake" in fatal or "waiting for config file" in fatal):
        pytest.skip(f"PyTriton could not restart its Python-backend stubs on this loaded machine: {fatal}"[:300])
    assert status == 200, answer[:500]
    [output] = json.loads(answer)["outputs"]
    np.testing.assert_allclose(np.asarray(output["data"], np.float32).reshape(output["shape"]), want, atol=1e-5)
    assert server.restarts == restarts + 1 and server.triton_pid != pid
