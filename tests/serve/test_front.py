"""The HTTP front alone, against a stand-in Triton on loopback (no PyTriton): its per-request shortcuts keep
every check and every count.

- A JSON header seen valid before is not parsed again, but each request's binary ids are still range-checked
  and a request it does not fit (another binary length) gets exactly the error a fresh front gives.
- Answers are written in one send with the base class's status line, Server and Date headers; bodies that
  come in pieces are read under the whole-body deadline; each request is counted once.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np

from layerzero.runtime._front import FrontSpec, InferenceFront, RequestError, Upstream
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
