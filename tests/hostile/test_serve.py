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
        # The front's own request id (it names a cached answer) cannot come from a client.
        ("reserved parameter", json.dumps({**good, "parameters": {"layerzero-request-id": "1-x-1"}}).encode(), {},
         400),
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


def _grpc_error(call: object) -> tuple[object, str]:
    import grpc

    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    details = caught.value.details() or ""
    assert "\n" not in details and "Traceback" not in details and "/tmp/" not in details, details
    return caught.value.code(), details


def test_http_and_grpc_answer_one_request_alike(served: SimpleNamespace) -> None:
    """Issue 21: over the served ports, each request of a table of hostile and valid ones gets the same answer
    from the HTTP and the gRPC front: the same status class (HTTP 4xx <-> its gRPC code) and the same line."""
    import grpc
    from tritonclient.grpc import service_pb2

    from layerzero.runtime.front.grpc_front import grpc_code

    channel = grpc.insecure_channel(f"127.0.0.1:{served.grpc}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)  # fmt: skip
    ids = example_feeds(served.config, batch=1, seq=4, seed=7)["input_ids"]

    def case(values: np.ndarray = ids, *, name: str = "input_ids", datatype: str = "INT64", shape: list | None = None,
             model: str = "layerzero", params: dict | None = None, outputs: list | None = None, twice: bool = False,
             count: int | None = None) -> tuple[str, bytes, service_pb2.ModelInferRequest]:  # fmt: skip
        shape = list(values.shape) if shape is None else shape
        flat = values.ravel().tolist()[: count if count is not None else None]
        tensor = {"name": name, "datatype": datatype, "shape": shape, "data": flat}
        doc: dict = {"inputs": [tensor] * (2 if twice else 1)}
        message = service_pb2.ModelInferRequest(model_name=model)
        for _ in range(2 if twice else 1):
            t = message.inputs.add(name=name, datatype=datatype, shape=shape)
            if datatype == "FP32":
                t.contents.fp32_contents.extend(float(v) for v in flat)
            else:
                t.contents.int64_contents.extend(flat)
        if params:
            doc["parameters"] = params
            for key, value in params.items():
                if isinstance(value, str):
                    message.parameters[key].string_param = value
                else:
                    message.parameters[key].int64_param = value
        if outputs:
            doc["outputs"] = [{"name": o} for o in outputs]
            for o in outputs:
                message.outputs.add(name=o)
        return f"/v2/models/{model}/infer", json.dumps(doc).encode(), message

    cases = {
        "valid": case(),
        "valid, a segment": case(params={"segment": "default"}),
        "id out of range": case(np.full((1, 4), 10**6, np.int64)),
        "negative id": case(-ids - 1),
        "wrong datatype": case(datatype="FP32"),
        "unknown input": case(name="nope"),
        "input twice": case(twice=True),
        "rank 3": case(ids.reshape(1, 1, 4)),
        "empty sequence": case(np.zeros((1, 0), np.int64)),
        "negative dim": case(shape=[1, -4]),
        "fewer values": case(count=3),
        "unknown model": case(model="other"),
        "segment not a string": case(params={"segment": 3}),
        "reserved parameter": case(params={"layerzero-request-id": "x"}),
        "unknown output": case(outputs=["nope"]),
    }
    try:
        for label, (path, body, message) in cases.items():
            status, answer = post(served.http, path, body)
            if label.startswith("valid"):
                assert status == 200, (label, answer)
                infer(message, timeout=60)
                continue
            error = json.loads(answer)["error"]
            code, details = _grpc_error(lambda m=message: infer(m, timeout=60))
            assert 400 <= status < 500 and code == grpc_code(status), (label, status, code)
            assert details == error, (label, error, details)
    finally:
        channel.close()


def test_grpc_gets_the_same_checks(served: SimpleNamespace) -> None:
    """The public gRPC port is the validating gRPC front: every bad ModelInfer a status and one line, counted."""
    import grpc
    from tritonclient.grpc import service_pb2

    requests_before, errors_before = _counters(served)
    channel = grpc.insecure_channel(f"127.0.0.1:{served.grpc}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)  # fmt: skip
    garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are

    def request(ids: np.ndarray, *, model: str = "layerzero", datatype: str = "INT64", raw: bytes | None = None,
                name: str = "input_ids", **params: object) -> service_pb2.ModelInferRequest:  # fmt: skip
        r = service_pb2.ModelInferRequest(model_name=model)
        r.inputs.add(name=name, datatype=datatype, shape=list(ids.shape))
        r.raw_input_contents.append(ids.tobytes() if raw is None else raw)
        for key, value in params.items():
            if isinstance(value, str):
                r.parameters[key].string_param = value
            else:
                r.parameters[key].int64_param = int(value)  # type: ignore[call-overload]
        return r

    ids = example_feeds(served.config, batch=1, seq=3, seed=4)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    try:
        bad = [
            (request(np.full((1, 3), 10**6, np.int64)), grpc.StatusCode.INVALID_ARGUMENT, "id 1000000 is out of range"),
            (request(np.zeros((1, 0), np.int64)), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
            (request(ids, raw=b"\0" * 5), grpc.StatusCode.INVALID_ARGUMENT, "5 bytes of binary data"),
            (request(ids, datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT, "datatype must be INT64"),
            (request(ids, name="nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'nope'"),
            (request(ids, model="other"), grpc.StatusCode.NOT_FOUND, "no model 'other'"),
            (request(ids, segment=3), grpc.StatusCode.INVALID_ARGUMENT, "segment"),
            (request(ids.reshape(1, 1, 3)), grpc.StatusCode.INVALID_ARGUMENT, "rank 3"),
        ]  # fmt: skip
        for message, code, needle in bad:
            got_code, details = _grpc_error(lambda m=message: infer(m, timeout=60))
            assert got_code == code and needle in details, (got_code, details)
        huge = service_pb2.ModelInferRequest(model_name="layerzero")
        huge.inputs.add(name="input_ids", datatype="INT64", shape=[1, 1_000_000_000, 16])
        huge.raw_input_contents.append(b"\0" * 8)
        code, details = _grpc_error(lambda: infer(huge, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 3" in details
        code, details = _grpc_error(lambda: garbage(b"\xff\x01garbage", timeout=60))  # not a protobuf message
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a ModelInferRequest" in details
        # Management is not served over the public port (as over HTTP); not inference, so not counted.
        load = channel.unary_unary("/inference.GRPCInferenceService/RepositoryModelLoad")
        assert _grpc_error(lambda: load(b"", timeout=60))[0] == grpc.StatusCode.UNIMPLEMENTED
        # ... and it still serves, correctly, with read-only queries forwarded.
        answer = infer(request(ids), timeout=120)
        got = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(list(answer.outputs[0].shape))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        metadata = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata",
                                       request_serializer=service_pb2.ModelMetadataRequest.SerializeToString,
                                       response_deserializer=service_pb2.ModelMetadataResponse.FromString)  # fmt: skip
        assert metadata(service_pb2.ModelMetadataRequest(name="layerzero"), timeout=60).name == "layerzero"
    finally:
        channel.close()
    requests_after, errors_after = _counters(served)
    assert requests_after - requests_before == 1
    assert errors_after - errors_before == len(bad) + 2


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address, port = local.split(":")
                if width == 8:
                    host = socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
                else:
                    words = bytes.fromhex(address)
                    host = socket.inet_ntop(socket.AF_INET6, b"".join(words[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add((host, int(port, 16)))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux) to list listening sockets")
def test_only_the_fronts_are_public_triton_listens_on_loopback(served: SimpleNamespace) -> None:
    server = served.server
    _wait_for_standby(server)
    public = {served.http, served.grpc, served.control}
    mine = _listening(os.getpid())
    assert served.control in {port for _, port in mine}, mine
    assert server.front_pid is not None and server.front_pid != os.getpid()
    fronts = _listening(server.front_pid)  # the HTTP and gRPC fronts: a process of their own
    assert {port for _, port in fronts} == {served.http, served.grpc}, fronts
    for pid in (server.triton_pid, server.standby_pid):
        assert pid is not None
        sockets = _listening(pid)
        assert sockets, f"tritonserver {pid} listens on nothing"
        # Triton's HTTP and gRPC: loopback only, none of the public ports; metrics, SageMaker, Vertex AI off.
        assert all(host in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for host, _ in sockets), sockets
        assert not public & {port for _, port in sockets}, sockets
        assert len(sockets) == 2, sockets


def test_the_front_adds_no_nagle_stall(served: SimpleNamespace) -> None:
    """One client, one request at a time: the front costs a few ms over Triton's own port, not a delayed ACK.

    Before the front sent each answer in one write with TCP_NODELAY, every request waited ~40 ms on it."""
    import http.client

    ids = example_feeds(served.config, batch=1, seq=6, seed=5)["input_ids"]
    body = json.dumps(_request(ids)).encode()
    path, headers = "/v2/models/layerzero/infer", {"Content-Type": "application/json"}

    def median_ms(port: int, n: int = 40) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        times = []
        try:
            for i in range(n + 5):
                t0 = time.perf_counter()
                conn.request("POST", path, body, headers)
                response = conn.getresponse()
                assert response.status == 200, response.read()[:300]
                response.read()
                if i >= 5:  # warm-up
                    times.append(time.perf_counter() - t0)
        finally:
            conn.close()
        return float(np.median(times)) * 1e3

    front = median_ms(served.http)
    assert served.server._active is not None
    direct = median_ms(served.server._active.http_port)
    front = min(front, median_ms(served.http))  # the lower of two: a noisy machine's spike is not the front
    assert front - direct < 15.0, f"front {front:.1f} ms vs Triton's own port {direct:.1f} ms"


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


def _stubs(workspace: object) -> list[int]:
    """Pids of the running Python-backend stubs of the Triton whose PyTriton workspace is ``workspace``."""
    stub = f"{workspace}/tritonserver/backends/python/triton_python_backend_stub".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().split(b"\0", 1)[0] == stub:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _wait_for_standby(server: object, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while server.standby_pid is None:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            pytest.fail(f"no standby Triton after {timeout:g} s")
        time.sleep(0.2)


def _one_send_connection() -> type:
    """An ``http.client.HTTPConnection`` that sends a request's head and body in one write. Python 3.11's sends them
    apart; with both cores taken by a Triton restart the test process was once starved past the fixture's 2 s body
    deadline (``TIMEOUT_S``) between the two writes, and the front answered 408, correctly, for a slow client: not
    what the restart test looks for."""
    import http.client

    class OneSend(http.client.HTTPConnection):
        def _send_output(self, message_body=None, encode_chunked=False):
            self._buffer.extend((b"", b""))
            head = b"\r\n".join(self._buffer)
            del self._buffer[:]
            self.send(head + bytes(message_body or b""))

    return OneSend


def test_killed_triton_is_replaced_in_under_a_second_and_no_request_lost(served: SimpleNamespace) -> None:
    """4 HTTP clients and 1 gRPC client send requests while Triton is SIGKILLed: the standby takes over in
    < 1 s, and every request (the ones in flight are sent again) is answered 200 with the right outputs."""
    import tritonclient.grpc as grpc_lib

    one_send = _one_send_connection()
    server = served.server
    _wait_for_standby(server)
    ids = example_feeds(served.config, batch=1, seq=4, seed=9)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    body = json.dumps(_request(ids)).encode()
    pid, standby, restarts = server.triton_pid, server.standby_pid, server.restarts
    workspace = server._active.triton._workspace.path
    assert _stubs(workspace), "no Python-backend stub found for the serving Triton"
    requests_before, errors_before = _counters(served)
    killed = threading.Event()
    failures: list[str] = []
    sent = [0] * 5
    latencies: list[float] = []

    def http_client(i: int) -> None:
        conn = one_send("127.0.0.1", served.http, timeout=120)
        try:
            for j in range(12):
                if j == 4:
                    killed.wait(60)
                t0 = time.monotonic()
                conn.request("POST", "/v2/models/layerzero/infer", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read()
                latencies.append(time.monotonic() - t0)
                sent[i] += 1
                if response.status != 200:
                    failures.append(f"http {response.status}: {answer[:200]!r}")
                    continue
                [output] = json.loads(answer)["outputs"]
                got = np.asarray(output["data"], np.float32).reshape(output["shape"])
                if not np.allclose(got, want, atol=1e-5):
                    failures.append("http: wrong answer")
        except Exception as e:  # a lost request is what this test looks for
            failures.append(f"http: {type(e).__name__}: {e}")
        finally:
            conn.close()

    def grpc_client() -> None:
        client = grpc_lib.InferenceServerClient(f"127.0.0.1:{served.grpc}")
        tensor = grpc_lib.InferInput("input_ids", list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        try:
            for j in range(12):
                if j == 4:
                    killed.wait(60)
                got = client.infer("layerzero", [tensor], client_timeout=120).as_numpy("logits")
                sent[4] += 1
                if not np.allclose(got, want, atol=1e-5):
                    failures.append("grpc: wrong answer")
        except Exception as e:  # a lost request is what this test looks for
            failures.append(f"grpc: {type(e).__name__}: {str(e)[:300]}")
        finally:
            client.close()

    threads = [threading.Thread(target=http_client, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=grpc_client))
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    killed.set()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures[:5]
    assert sum(sent) == 5 * 12
    assert server.restarts == restarts + 1 and server.triton_pid == standby != pid
    assert server.last_restart_s is not None and server.last_restart_s < 1.0, server.last_restart_s
    requests_after, errors_after = _counters(served)
    # A request in flight when Triton died may have run in the infer callable (this process) with its answer
    # lost with Triton: the front sends it again with the same request id, and the callable answers it from
    # that first run. Each request is counted exactly once.
    assert requests_after - requests_before == 5 * 12 and errors_after == errors_before
    # The dead Triton's Python-backend stubs (orphaned by the SIGKILL, deaf to SIGTERM) are gone too.
    deadline = time.monotonic() + 60
    while _stubs(workspace) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _stubs(workspace), _stubs(workspace)
    # A new standby comes up for the next time.
    _wait_for_standby(server)
    assert server.standby_pid not in (pid, standby)


def test_grpc_messages_over_the_limit_are_refused_and_counted(served: SimpleNamespace) -> None:
    """A ModelInfer over --max-request-bytes is RESOURCE_EXHAUSTED and counted: one a little over the limit by
    the front's code (one line of its own), one far over it by gRPC itself (counted as its call ends)."""
    import grpc
    from tritonclient.grpc import service_pb2

    requests_before, errors_before = _counters(served)
    channel = grpc.insecure_channel(f"127.0.0.1:{served.grpc}", options=[("grpc.max_send_message_length", -1)])
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)  # fmt: skip

    def message(n: int) -> service_pb2.ModelInferRequest:
        r = service_pb2.ModelInferRequest(model_name="layerzero")
        r.inputs.add(name="input_ids", datatype="INT64", shape=[1, n])
        r.raw_input_contents.append(np.zeros((1, n), np.int64).tobytes())
        return r

    try:
        code, details = _grpc_error(lambda: infer(message(MAX_BYTES // 8 + 1000), timeout=60))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {MAX_BYTES}" in details, details
        code, details = _grpc_error(lambda: infer(message(4 * MAX_BYTES // 8), timeout=60))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    finally:
        channel.close()
    # The second is counted when gRPC drops its call, just after answering: wait for it (bounded).
    deadline = time.monotonic() + 10
    while _counters(served)[1] - errors_before < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    requests_after, errors_after = _counters(served)
    assert errors_after - errors_before == 2 and requests_after == requests_before


def test_killed_front_is_restarted_and_no_count_lost(served: SimpleNamespace) -> None:
    """SIGKILL the front process: the supervisor starts a new one on the same ports; the errors the dead one
    counted are kept, and the new one's counts add to them."""
    server = served.server
    ids = example_feeds(served.config, batch=1, seq=5, seed=11)["input_ids"]
    want = served.engine.run({"input_ids": ids}).outputs["logits"]
    bad = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 0], "datatype": "INT64", "data": []}]}).encode()
    good = json.dumps(_request(ids)).encode()
    requests_before, errors_before = _counters(served)
    for _ in range(3):
        assert_one_line(*post(served.http, "/v2/models/layerzero/infer", bad), 400)
    old = server.front_pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        try:
            status, answer = post(served.http, "/v2/models/layerzero/infer", good)
            break
        except OSError:  # refused while the new front starts
            if time.monotonic() > deadline:
                pytest.fail("the front was not restarted within 120 s")
            time.sleep(0.1)
    assert status == 200, answer[:300]
    [output] = json.loads(answer)["outputs"]
    np.testing.assert_allclose(np.asarray(output["data"], np.float32).reshape(output["shape"]), want, atol=1e-5)
    assert server.front_pid not in (None, old) and server.front_restarts >= 1
    assert_one_line(*post(served.http, "/v2/models/layerzero/infer", bad), 400)
    requests_after, errors_after = _counters(served)
    assert errors_after - errors_before == 4 and requests_after - requests_before == 1


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` and their command lines (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            found[int(entry)] = command
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux) to list child processes")
def test_no_grpc_serves_http_only_and_stop_leaves_no_process(tiny: SimpleNamespace, helpers: SimpleNamespace) -> None:
    """``ServerConfig(grpc=False)`` (``--no-grpc``): the gRPC port is not opened, HTTP serves; after ``stop()`` no
    process the server started is left (the front, Triton and its stubs)."""
    from layerzero.runtime.guard import GuardConfig, GuardedEngine
    from layerzero.runtime.server import LayerZeroServer, ServerConfig

    before = _children(os.getpid())
    http_port, grpc_port, control_port = helpers.free_ports(3)
    engine = Engine.load(tiny.bundle)
    server = LayerZeroServer(GuardedEngine(engine, None, GuardConfig(sample_rate=0.0)),
                             ServerConfig(http_port=http_port, grpc_port=grpc_port, control_port=control_port,
                                          grpc=False, standby=False))  # fmt: skip
    try:
        try:
            server.start()
        except LayerZeroError as e:
            if "waiting for config file" in str(e) or "handshake" in str(e):
                pytest.skip(f"PyTriton could not start its Python-backend stubs on this loaded machine: {e}"[:300])
            raise
        started = set(_children(os.getpid())) - set(before)
        assert server.front_pid in started and server.triton_pid in started, (started, server.front_pid)
        ids = example_feeds(tiny.config, batch=1, seq=4, seed=3)["input_ids"]
        status, answer = post(http_port, "/v2/models/layerzero/infer", json.dumps(_request(ids)).encode())
        assert status == 200, answer[:300]
        [output] = json.loads(answer)["outputs"]
        want = engine.run({"input_ids": ids}).outputs["logits"]
        np.testing.assert_allclose(np.asarray(output["data"], np.float32).reshape(output["shape"]), want, atol=1e-5)
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", grpc_port), timeout=5):
            pass
        assert "grpc" not in server.endpoints()
    finally:
        server.stop()
    # multiprocessing's resource tracker (PyTriton's shared memory starts it) serves the whole interpreter and
    # ends with it: not the server's.
    left = {pid: command for pid, command in _children(os.getpid()).items()
            if pid not in before and "multiprocessing.resource_tracker" not in command}  # fmt: skip
    assert not left, left


def test_a_resent_request_runs_and_is_counted_once(served: SimpleNamespace) -> None:
    """The infer callable keeps answers by the front's request id: a request the front sends again (Triton died
    with it in flight) gets the first run's answer, or its error, and is counted once."""
    from layerzero.runtime.front import REQUEST_ID

    server = served.server
    ids = example_feeds(served.config, batch=1, seq=4, seed=13)["input_ids"]
    requests_before, errors_before = _counters(served)
    request = SimpleNamespace(data={"input_ids": ids}, parameters={REQUEST_ID: "test-resent-1"})
    [first] = server._infer([request])
    [again] = server._infer([request])
    assert again["logits"] is first["logits"]
    np.testing.assert_allclose(first["logits"], served.engine.run({"input_ids": ids}).outputs["logits"], atol=1e-5)
    out_of_range = np.full((1, 3), 10**6, np.int64)
    bad = SimpleNamespace(data={"input_ids": out_of_range}, parameters={REQUEST_ID: "test-resent-2"})
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"\[layerzero 400\] .*out of range"):
            server._infer([bad])
    # Without an id (not through the front) each call runs.
    server._infer([SimpleNamespace(data={"input_ids": ids}, parameters={})])
    requests_after, errors_after = _counters(served)
    assert requests_after - requests_before == 2 and errors_after - errors_before == 1
