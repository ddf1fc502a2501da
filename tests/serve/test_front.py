"""The HTTP front alone, against a stand-in Triton on loopback (no PyTriton): its per-request shortcuts keep
every check and every count.

- A JSON header seen valid before is not parsed again, but each request's binary ids are still range-checked
  and a request it does not fit (another binary length) gets exactly the error a fresh front gives.
- Answers are written in one send with the base class's status line, Server and Date headers; bodies that
  come in pieces are read under the whole-body deadline; each request is counted once.
- The HTTP and the gRPC front give one request one answer (one ``check_request`` behind both decoders).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from layerzero.runtime.front import FrontSpec, InferenceFront, RequestError, Upstream
from layerzero.runtime.triton_repo import IOSpec

ROWS = 256
SEQ = 16
_OUTPUT = {"name": "logits", "datatype": "FP32", "shape": [1, SEQ, 4], "parameters": {"binary_data_size": SEQ * 16}}
ANSWER_HEAD = json.dumps({"model_name": "m", "outputs": [_OUTPUT]}).encode()
ANSWER = ANSWER_HEAD + np.arange(SEQ * 4, dtype=np.float32).tobytes()


def _spec(timeout_s: float = 2.0) -> FrontSpec:
    return FrontSpec(model_name="m", inputs=[IOSpec("input_ids", "TYPE_INT64", (1, -1))], outputs=["logits"],
                     index_ranges={"input_ids": ROWS}, host="127.0.0.1", http_port=0, grpc_port=None,
                     max_request_bytes=1 << 20, client_timeout_s=timeout_s, restart_wait_s=2.0)  # fmt: skip


@contextlib.contextmanager
def _front(timeout_s: float = 2.0) -> Iterator[InferenceFront]:
    front = InferenceFront(_spec(timeout_s), Upstream())
    front.start()  # stop() waits for the serving thread: started even where only validate() is called
    try:
        yield front
    finally:
        front.stop()


def _request(ids: np.ndarray, *, declared: int | None = None, extra: bytes = b"") -> tuple[bytes, str]:
    """A tritonclient-style binary request: its body and Inference-Header-Content-Length."""
    data = ids.astype(np.int64).tobytes()
    head = json.dumps({"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
                                   "parameters": {"binary_data_size": declared if declared is not None
                                                  else len(data)}}]}).encode()  # fmt: skip
    return head + data + extra, str(len(head))


def _json_request(ids: list[int]) -> bytes:
    """A request with its ids in the JSON (no binary data)."""
    tensor = {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}
    return json.dumps({"inputs": [tensor]}).encode()


def _outcome(front: InferenceFront, body: bytes, header_length: str | None) -> tuple[int, str]:
    try:
        front.validate("m", body, header_length)
    except RequestError as e:
        return e.status, str(e)
    return 200, ""


def _cases() -> list[tuple[str, bytes, str | None]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(1, SEQ))
    high, low = ids.copy(), ids.copy()
    high[0, 7], low[0, 3] = ROWS, -1
    body, length = _request(ids)
    return [
        ("valid", body, length),
        ("valid again, other ids", *_request(rng.integers(0, ROWS, size=(1, SEQ)))),
        ("id = rows", *_request(high)),
        ("negative id", *_request(low)),
        ("int64 min", *_request(np.full((1, SEQ), np.iinfo(np.int64).min))),
        ("8 bytes short", body[:-8], length),
        ("8 bytes more", body + b"\0" * 8, length),
        ("header length off by one", body, str(int(length) - 1)),
        ("declared size wrong", *_request(ids, declared=8 * SEQ - 8)),
        ("JSON data, out of range", _json_request([1, ROWS]), None),
        ("JSON data, valid", _json_request([1, 2]), None),
    ]


def test_a_known_header_gives_what_a_fresh_front_gives() -> None:
    """Every case's outcome from a front that has seen the valid header equals a fresh front's, twice over."""
    with _front() as warm:
        body, length = _request(np.zeros((1, SEQ), np.int64))
        assert _outcome(warm, body, length) == (200, "")
        assert len(warm._valid_heads) == 1  # the shortcut is in play for every case below
        for name, case_body, case_length in _cases() * 2:
            with _front() as cold:
                expected = _outcome(cold, case_body, case_length)
            assert _outcome(warm, case_body, case_length) == expected, name
        outcomes = {name: _outcome(warm, b, n)[0] for name, b, n in _cases()}
    assert outcomes == {"valid": 200, "valid again, other ids": 200, "id = rows": 400, "negative id": 400,
                        "int64 min": 400, "8 bytes short": 400, "8 bytes more": 400,
                        "header length off by one": 400, "declared size wrong": 400,
                        "JSON data, out of range": 400, "JSON data, valid": 200}  # fmt: skip


def test_only_valid_binary_headers_are_remembered_and_at_most_64() -> None:
    with _front() as front:
        _outcome(front, *_request(np.full((1, SEQ), ROWS)))  # refused: not remembered
        _outcome(front, _json_request([1]), None)
        assert front._valid_heads == {}
        for seq in range(1, 101):
            assert _outcome(front, *_request(np.ones((1, seq), np.int64))) == (200, "")
            assert 1 <= len(front._valid_heads) <= 64


# ------------------------------------------------------------------ end to end against a stand-in Triton


class _StandIn:
    """Triton's HTTP port as the front sees it: keep-alive, answers every request with ``ANSWER``."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with contextlib.suppress(OSError), conn:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)  # fmt: skip
                self.requests.append(head + reader.read(length))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                             b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(ANSWER_HEAD), len(ANSWER), ANSWER))  # fmt: skip

    def close(self) -> None:
        self.sock.close()


def _read_answer(reader: object) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])  # type: ignore[attr-defined]
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):  # type: ignore[attr-defined]
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.lower()] = value.strip()
    return status, headers, reader.read(int(headers["content-length"]))  # type: ignore[attr-defined]


def test_front_forwards_answers_and_counts_each_request_once() -> None:
    stand_in = _StandIn()
    with _front(timeout_s=1.0) as front:
        front.upstream.set_triton(stand_in.port, 0, None)
        port = front._httpd.server_address[1]
        ids = np.random.default_rng(1).integers(0, ROWS, size=(1, SEQ))
        good, good_length = _request(ids)
        bad, bad_length = _request(np.full((1, SEQ), ROWS))
        path = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %s\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            reader = client.makefile("rb")
            statuses = []
            for i in range(40):
                body, length = (bad, bad_length) if i % 5 == 4 else (good, good_length)
                message = path % length.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body
                if i % 10 == 3:  # the body in two pieces, a little apart: read under the deadline
                    client.sendall(message[:-20])
                    time.sleep(0.05)
                    client.sendall(message[-20:])
                else:
                    client.sendall(message)
                status, headers, answer = _read_answer(reader)
                statuses.append(status)
                if status == 200:
                    assert answer == ANSWER
                    assert headers["inference-header-content-length"] == str(len(ANSWER_HEAD))
                else:
                    assert status == 400 and f"id {ROWS} is out of range" in json.loads(answer)["error"]
                assert headers["server"].startswith("BaseHTTP/") and headers["date"].endswith(" GMT")
            # A body that stops half-way is cut off at the client timeout (1 s), counted as an error.
            started = time.monotonic()
            client.sendall(path % good_length.encode() + b"Content-Length: %d\r\n\r\n" % len(good) + good[:50])
            status, headers, answer = _read_answer(reader)
            assert status == 408 and headers["connection"] == "close"
            assert 0.9 < time.monotonic() - started < 5
    stand_in.close()
    assert statuses.count(200) == 32 and statuses.count(400) == 8
    assert len(stand_in.requests) == 32  # refused ones never reach Triton
    assert all(b"layerzero-request-id: " in r for r in stand_in.requests)
    assert len({r.split(b"layerzero-request-id: ")[1].split(b"\r\n")[0] for r in stand_in.requests}) == 32
    assert (front.upstream._slots[1], front.upstream._slots[0]) == (41, 9)  # requests, errors: each once


def test_a_silent_body_is_cut_off_at_the_deadline() -> None:
    """Headers, then no body byte at all: 408 after the client timeout (the first read's own timeout)."""
    timeout_s = 1.0
    with _front(timeout_s=timeout_s) as front:
        port = front._httpd.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            started = time.monotonic()
            client.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
            status, _, answer = _read_answer(client.makefile("rb"))
        assert status == 408 and "not received in time" in json.loads(answer)["error"]
        assert timeout_s * 0.9 < time.monotonic() - started < timeout_s + 4


# --------------------------------------------------------------------------------- HTTP and gRPC: one answer

PAST = [-1, 2, -1, 4]  # a KV cache's past: [batch, heads, past, head_dim], the past (only) may be empty


def _parity_spec() -> FrontSpec:
    inputs = [IOSpec("input_ids", "TYPE_INT64", (1, -1)), IOSpec("past", "TYPE_FP32", tuple(PAST))]
    return FrontSpec(model_name="m", inputs=inputs, outputs=["logits"], index_ranges={"input_ids": ROWS},
                     host="127.0.0.1", http_port=0, grpc_port=0, max_request_bytes=1 << 20, client_timeout_s=2.0,
                     restart_wait_s=2.0, empty_axes={"past": [2]})  # fmt: skip


def _tensor(name: str, values: np.ndarray, datatype: str | None = None, shape: list | None = None) -> dict:
    kind = {"i": "INT64", "f": "FP32"}[values.dtype.kind]
    return {"name": name, "datatype": datatype or kind, "shape": list(values.shape) if shape is None else shape,
            "values": values}  # fmt: skip


def _as_http(request: dict, binary: bool) -> tuple[bytes, str | None]:
    """The request as tritonclient sends it over HTTP: values in the JSON, or as binary data after it."""
    inputs, data = [], b""
    for t in request["inputs"]:
        doc = {"name": t["name"], "datatype": t["datatype"], "shape": t["shape"]}
        raw = t["values"].tobytes()
        if binary:
            doc["parameters"] = {"binary_data_size": len(raw)}
            data += raw
        else:
            doc["data"] = t["values"].ravel().tolist()
        inputs.append(doc)
    head: dict = {"inputs": inputs}
    if request.get("params"):
        head["parameters"] = request["params"]
    if request.get("outputs"):
        head["outputs"] = [{"name": n} for n in request["outputs"]]
    text = json.dumps(head).encode()
    return (text + data, str(len(text))) if binary else (text, None)


def _as_grpc(request: dict, binary: bool) -> bytes:
    """The same request as a ModelInferRequest: raw_input_contents, or typed contents."""
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name=request.get("model", "m"))
    for t in request["inputs"]:
        tensor = message.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        if binary:
            message.raw_input_contents.append(t["values"].tobytes())
        elif t["values"].dtype.kind == "i":
            tensor.contents.int64_contents.extend(t["values"].ravel().tolist())
        else:
            tensor.contents.fp32_contents.extend(t["values"].ravel().tolist())
    for key, value in (request.get("params") or {}).items():
        if isinstance(value, str):
            message.parameters[key].string_param = value
        else:
            message.parameters[key].int64_param = value
    for name in request.get("outputs") or []:
        message.outputs.add(name=name)
    return message.SerializeToString()


def _parity_cases() -> list[tuple[str, dict]]:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, ROWS, size=(1, 5)).astype(np.int64)
    past = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    empty, no_batch = np.zeros((1, 2, 0, 4), np.float32), np.zeros((0, 2, 3, 4), np.float32)
    high = ids.copy()
    high[0, 2] = ROWS

    def request(*inputs: dict, **extra: object) -> dict:
        return {"inputs": list(inputs), **extra}

    good = (_tensor("input_ids", ids), _tensor("past", past))
    return [
        ("valid", request(*good)),
        ("valid, an empty past (a first step)", request(_tensor("input_ids", ids), _tensor("past", empty))),
        ("valid, a string segment", request(*good, params={"segment": "chat"})),
        ("valid, a known output", request(*good, outputs=["logits"])),
        ("an empty input_ids", request(_tensor("input_ids", np.zeros((1, 0), np.int64)), _tensor("past", past))),
        ("a past with no batch", request(_tensor("input_ids", ids), _tensor("past", no_batch))),
        ("id = rows", request(_tensor("input_ids", high), _tensor("past", past))),
        ("negative id", request(_tensor("input_ids", -ids - 1), _tensor("past", past))),
        ("wrong datatype", request(_tensor("input_ids", ids.astype(np.float32)), _tensor("past", past))),
        ("unknown input", request(*good, _tensor("nope", ids))),
        ("input twice", request(*good, _tensor("input_ids", ids))),
        ("missing input", request(_tensor("input_ids", ids))),
        ("wrong rank", request(_tensor("input_ids", ids.reshape(1, 1, 5)), _tensor("past", past))),
        ("fixed dim differs", request(_tensor("input_ids", ids), _tensor("past", np.zeros((1, 3, 3, 4), np.float32)))),
        ("negative dim", request(_tensor("input_ids", ids, shape=[1, -5]), _tensor("past", past))),
        ("huge dims", request(_tensor("input_ids", ids, shape=[1, 10**12]), _tensor("past", past))),
        ("rank 17", request(_tensor("input_ids", ids, shape=[1] * 17), _tensor("past", past))),
        ("fewer values than the shape", request(_tensor("input_ids", ids, shape=[1, 6]), _tensor("past", past))),
        ("unknown model", request(*good, model="other")),
        ("a segment that is not a string", request(*good, params={"segment": 3})),
        ("the reserved request id", request(*good, params={"layerzero-request-id": "x"})),
        ("an unknown output", request(*good, outputs=["nope"])),
    ]  # fmt: skip


def test_http_and_grpc_give_one_answer_to_one_request() -> None:
    """Issue 21: both fronts run one check_request (a JSON and a protobuf decoder before it). The same request
    gets the same status and line over HTTP and gRPC, its values as binary data or in the message alike."""
    from layerzero.runtime.front import GrpcFront

    spec = _parity_spec()
    http = InferenceFront(spec, Upstream())
    grpc_front = GrpcFront(spec, Upstream(), http)
    http.start()
    try:
        answers = {}
        for name, request in _parity_cases():
            for binary in (True, False):
                body, length = _as_http(request, binary)
                http_answer = _outcome(http, body, length) if "model" not in request else _http_model(http, request,
                                                                                                       body, length)
                try:
                    grpc_front.validate(_as_grpc(request, binary))
                    grpc_answer = (200, "")
                except RequestError as e:
                    grpc_answer = (e.status, str(e))
                assert http_answer == grpc_answer, (name, binary, http_answer, grpc_answer)
                answers[name, binary] = http_answer
    finally:
        http.stop()
        grpc_front.stop()
    # And the answers are the ones meant, not merely equal.
    for binary in (True, False):
        assert all(answers[name, binary] == (200, "") for name, _ in _parity_cases()[:4])
        assert answers["an empty input_ids", binary][1].startswith("input 'input_ids': shape [1, 0] is empty")
        assert "shape [0, 2, 3, 4] is empty" in answers["a past with no batch", binary][1]
        assert answers["id = rows", binary] == (400, f"input 'input_ids': id {ROWS} is out of range [0, {ROWS})")
        assert answers["unknown model", binary][0] == 404
        assert answers["rank 17", binary][1] == "input 'input_ids': shape must be a list of at most 16 integers"
        assert all(answers[name, binary][0] == 400 for name, _ in _parity_cases()[4:] if name != "unknown model")


def _http_model(front: InferenceFront, request: dict, body: bytes, length: str | None) -> tuple[int, str]:
    try:
        front.validate(str(request["model"]), body, length)
    except RequestError as e:
        return e.status, str(e)
    return 200, ""


def test_grpc_call_reset_by_a_dying_triton_is_sent_again() -> None:
    """A SIGKILLed Triton resets its gRPC streams ("Stream removed") a few ms before its process is gone: the
    gRPC front took that UNAVAILABLE for Triton's answer while the pid still looked alive, and a client's call
    failed during a replacement (tests/hostile test_killed_triton_..., now and then). It is sent again (the
    request id runs it once) for a moment; an UNAVAILABLE that lasts is still answered as it is."""
    import grpc

    from layerzero.runtime.front import GrpcFront
    from layerzero.runtime.front.grpc_front import GrpcUpstreamError

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "Stream removed"

    class Context:
        def time_remaining(self) -> None:
            return None

    spec = _parity_spec()
    upstream = Upstream()
    upstream.set_triton(1, 2, None)  # pid unknown: alive, as the dying one still looked
    front = GrpcFront(spec, upstream)
    calls: list[bytes] = []

    def flaky(raw: bytes, timeout: float | None, metadata: object) -> bytes:
        calls.append(raw)
        if len(calls) < 3:
            raise Unavailable()
        return b"answer"

    front._callable = lambda port, method: flaky  # type: ignore[method-assign]
    try:
        assert front._forward("/inference.GRPCInferenceService/ModelInfer", b"x", Context(), True) == b"answer"
        assert len(calls) == 3

        def down(raw: bytes, timeout: float | None, metadata: object) -> bytes:
            raise Unavailable()

        front._callable = lambda port, method: down  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(GrpcUpstreamError, match="Stream removed"):
            front._forward("/inference.GRPCInferenceService/ServerReady", b"", Context(), False)
        assert time.monotonic() - started < 5
    finally:
        front.stop()
