"""The inference fronts of ``layerzero serve`` (HTTP and gRPC), in a process of their own.

    front = FrontProcess(FrontSpec(...))       # the parent (``LayerZeroServer``) starts it
    front.start()                              # returns once both ports listen (or raises, one line)
    front.set_triton(http_port, grpc_port, pid)
    front.errors                               # requests refused or failed in the front, counted there
    front.stop()                               # nothing left running

Why a process: the fronts' Python (reading, validating and forwarding each request) shared the GIL with
PyTriton's proxy and the infer callable; with 8 clients the front doubled p50. Here it has an interpreter of its
own: ``python -m layerzero.runtime._front`` reads a ``FrontSpec`` (the model facts it validates against: inputs,
outputs, index ranges, limits) as one JSON line on stdin, answers one line (ready, or the error), then follows
commands on stdin, one JSON line each: ``{"triton": [http_port, grpc_port, pid]}`` (where to forward),
``{"restarting": true}`` (hold requests: the supervisor is replacing Triton), ``{"stop": true}``. The end of
stdin (the parent died) stops it too.

Counts the parent must report reach it through a small shared file mapping written only by the front (slot 0:
errors, slot 1: inference requests seen): the parent reads them at scrape time, so nothing is counted twice
or lost when the front dies and is restarted (the mapping is the parent's and outlives it).

Each forwarded inference request carries a header (HTTP) or metadata entry (gRPC) ``layerzero-request-id``,
which Triton hands to the infer callable as a request parameter: a request sent again after Triton died
with it in flight is run and counted once (see ``LayerZeroServer._infer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import http
import itertools
import json
import logging
import mmap
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import IO, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime._http import listen_http
from layerzero.runtime.triton_repo import IOSpec

__all__ = ["REQUEST_ID", "FrontProcess", "FrontSpec", "GrpcFront", "InferenceFront", "RequestError", "Upstream"]

logger = logging.getLogger(__name__)

#: The header / gRPC metadata key of the front's request id, forwarded by Triton as a request parameter.
REQUEST_ID = "layerzero-request-id"
#: Bytes of the shared counters mapping: slot 0 errors, slot 1 inference requests seen by the front.
_COUNTERS_BYTES = 64
_ERRORS, _REQUESTS = 0, 8
#: How long the parent waits for a front to listen (imports on a loaded machine take seconds).
_START_TIMEOUT_S = 120.0


@dataclasses.dataclass
class FrontSpec:
    """What a front process needs: the model facts it validates against and its limits."""

    model_name: str
    inputs: list[IOSpec]
    outputs: list[str]
    index_ranges: dict[str, int]
    host: str
    http_port: int
    grpc_port: int | None  # None: no gRPC front
    max_request_bytes: int
    client_timeout_s: float
    restart_wait_s: float
    instances: int = 2
    empty_axes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # see server.empty_axes

    def to_json(self) -> str:
        doc = dataclasses.asdict(self)
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> FrontSpec:
        doc = json.loads(text)
        doc["inputs"] = [IOSpec(s["name"], s["data_type"], tuple(s["dims"])) for s in doc["inputs"]]
        return cls(**doc)


class Upstream:
    """The front's view of Triton (where it listens, whether it is being replaced) and its shared counters."""

    def __init__(self, counters: mmap.mmap | None = None) -> None:
        self.ready = threading.Event()  # set while a Triton serves; cleared while the supervisor replaces it
        self.stopping = threading.Event()
        self.current: tuple[int, int, int | None] | None = None  # (http port, grpc port, pid), one assignment
        self._counters = counters if counters is not None else mmap.mmap(-1, _COUNTERS_BYTES)
        self._slots = memoryview(self._counters).cast("q")  # slot i at byte offset 8 i
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid()}-{secrets.token_hex(4)}-"

    def set_triton(self, http_port: int, grpc_port: int, pid: int | None) -> None:
        self.current = (http_port, grpc_port, pid)
        self.ready.set()

    def restarting(self) -> None:
        self.ready.clear()

    def alive(self, current: tuple[int, int, int | None]) -> bool:
        """Whether the Triton ``current`` names still runs and is still the one to forward to."""
        return self.current == current and _pid_alive(current[2])

    def wait(self, deadline: float) -> tuple[int, int, int | None]:
        """The Triton to forward to, waiting out a restart until ``deadline`` (then 503)."""
        current = self.current
        if current is not None and self.ready.is_set() and not self.stopping.is_set():
            return current  # the common case, without Event.wait's condition and lock
        while True:
            left = deadline - time.monotonic()
            if not self.ready.wait(timeout=max(0.0, left)) or self.stopping.is_set():
                raise RequestError(503, "the inference server is restarting; retry")
            current = self.current
            if current is not None:
                return current
            time.sleep(0.005)

    def next_id(self) -> str:
        return self._prefix + str(next(self._ids))

    def count_error(self) -> None:
        self._add(_ERRORS)

    def count_request(self) -> None:
        self._add(_REQUESTS)

    def _add(self, offset: int) -> None:
        # NOTE: one writer (this process, under the lock); the parent only reads. An aligned 8-byte store.
        with self._lock:
            self._slots[offset // 8] += 1


def _pid_alive(pid: int | None) -> bool:
    if pid is None:
        return True  # unknown: assume so (a dead one shows as refused connections, sent again)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        return True


# ----------------------------------------------------------------------------------- the parent's side


class FrontProcess:
    """A front process (``python -m layerzero.runtime._front``), started and followed by the parent."""

    def __init__(self, spec: FrontSpec) -> None:
        self.spec = spec
        # The mapping's file lives as long as this object (closed in close()), not a with-block.
        self._counters_file = tempfile.TemporaryFile()  # noqa: SIM115
        self._counters_file.truncate(_COUNTERS_BYTES)
        self._counters = mmap.mmap(self._counters_file.fileno(), _COUNTERS_BYTES)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._triton: tuple[int, int, int | None] | None = None
        self.starts = 0  # how many front processes were started (restarts = starts - 1)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def errors(self) -> int:
        """Inference requests the front refused or saw fail without the infer callable counting them."""
        return int(struct.unpack_from("q", self._counters, _ERRORS)[0])

    @property
    def requests(self) -> int:
        """Inference requests the front received (valid or not)."""
        return int(struct.unpack_from("q", self._counters, _REQUESTS)[0])

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.poll() is None

    def start(self) -> None:
        """Start the process; return once its ports listen. Raises ``InvalidInputError`` (a port it cannot
        listen on) or ``LayerZeroError`` (it did not start), one line."""
        fd = self._counters_file.fileno()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen(
            [sys.executable, "-m", "layerzero.runtime._front", str(fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), env=env, close_fds=True,
        )  # fmt: skip
        self._process = process
        self.starts += 1
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write((self.spec.to_json() + "\n").encode())
            process.stdin.flush()
        except OSError:
            pass  # it died at once: its answer (none) says so below
        answer = _read_line(process.stdout, _START_TIMEOUT_S)
        doc: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            doc = json.loads(answer) if answer else {}
        if doc.get("ready") is True:
            if self._triton is not None:
                self._send({"triton": list(self._triton)})
            return
        self.kill()
        if doc.get("invalid"):
            raise InvalidInputError(str(doc["invalid"]))
        raise LayerZeroError(f"the inference front did not start: {doc.get('error') or 'it exited'}")

    def set_triton(self, http_port: int, grpc_port: int, pid: int | None) -> None:
        self._triton = (http_port, grpc_port, pid)
        self._send({"triton": list(self._triton)})

    def restarting(self) -> None:
        self._triton = None
        self._send({"restarting": True})

    def _send(self, doc: dict[str, Any]) -> None:
        process = self._process
        if process is None or process.stdin is None:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):  # a dead front is restarted by the supervisor
            process.stdin.write((json.dumps(doc) + "\n").encode())
            process.stdin.flush()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the process (gracefully, then SIGKILL) and wait for it: nothing is left running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with self._lock, contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.write(b'{"stop": true}\n')
                process.stdin.flush()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    def kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self.stop()

    def close(self) -> None:
        """Stop it and release the counters (read ``errors`` before)."""
        self.stop()
        with contextlib.suppress(Exception):
            self._counters.close()
            self._counters_file.close()


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    """One line from a child's stdout, or b"" when it closes or ``timeout`` passes."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline(65536)), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else b""


# ----------------------------------------------------------------------------------- the front's side


def main(argv: list[str] | None = None) -> int:
    """The front process: see the module doc."""
    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C in a terminal reaches the whole process group: the parent shuts down and stops this process in
    # order (stdin's {"stop"} or its end); no KeyboardInterrupt traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="layerzero front: %(levelname)s %(message)s")
    out = sys.stdout.buffer

    def answer(doc: dict[str, Any]) -> None:
        out.write((json.dumps(doc) + "\n").encode())
        out.flush()

    fd = int(argv[0])
    counters = mmap.mmap(fd, _COUNTERS_BYTES)
    spec = FrontSpec.from_json(sys.stdin.buffer.readline().decode())
    upstream = Upstream(counters)
    fronts: list[Any] = []
    try:
        http = InferenceFront(spec, upstream)
        fronts.append(http)
        if spec.grpc_port is not None:
            fronts.append(GrpcFront(spec, upstream, http))
        for front in fronts:
            front.start()
    except InvalidInputError as e:
        answer({"invalid": str(e)})
        return 2
    except Exception as e:
        answer({"error": _one_line(f"{type(e).__name__}: {e}", 300)})
        return 1
    answer({"ready": True})
    for line in sys.stdin.buffer:  # until {"stop"} or the parent is gone (end of stdin)
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if "triton" in doc:
            upstream.set_triton(*doc["triton"])
        elif doc.get("restarting"):
            upstream.restarting()
        elif doc.get("stop"):
            break
    upstream.stopping.set()
    upstream.ready.set()  # waiting requests answer 503 at once
    for front in reversed(fronts):
        with contextlib.suppress(Exception):
            front.stop()
    return 0


# ------------------------------------------------------------------------------------------ the HTTP front

class RequestError(Exception):
    """A request refused with an HTTP status (4xx) and a one-line message; counted as a request error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(_one_line(message))
        self.status = status


# The infer callable raises with this marker; Triton/PyTriton wrap it in a traceback, the front finds it
# again and answers its status and line, nothing else.
_MARKER = re.compile(r"\[layerzero (\d{3})\] ([^\n\\]*)")
_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
# KServe v2 datatypes by Triton config type, and bytes per element (0: variable, BYTES).
_KSERVE = {
    "TYPE_BOOL": ("BOOL", 1), "TYPE_UINT8": ("UINT8", 1), "TYPE_UINT16": ("UINT16", 2),
    "TYPE_UINT32": ("UINT32", 4), "TYPE_UINT64": ("UINT64", 8), "TYPE_INT8": ("INT8", 1),
    "TYPE_INT16": ("INT16", 2), "TYPE_INT32": ("INT32", 4), "TYPE_INT64": ("INT64", 8),
    "TYPE_FP16": ("FP16", 2), "TYPE_FP32": ("FP32", 4), "TYPE_FP64": ("FP64", 8), "TYPE_BF16": ("BF16", 2),
    "TYPE_STRING": ("BYTES", 0),
}  # fmt: skip
_MAX_RANK = 16
#: validate()'s memory of JSON headers that passed: headers up to this size, this many (then forgotten).
_HEAD_CACHE_BYTES = 4096
_HEAD_CACHE_ENTRIES = 64


def _one_line(message: str, limit: int = 400) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class InferenceFront:
    """The HTTP front of Triton's KServe v2 API: every inference request is read (capped, with a deadline) and
    validated against the model before Triton parses it, then forwarded to Triton on a loopback port.

    Cases refused (4xx, one line, counted in ``layerzero_request_errors_total``):
    1. no or bad ``Content-Length`` (411 / 400), a body over ``max_request_bytes`` (413), a compressed body (415);
    2. not JSON, nested too deep, not the KServe v2 shape; an unknown model (404), input, output or datatype;
    3. a shape whose rank or fixed dims differ from the model's, with a negative or empty dim (an empty
       sequence), or more elements than the body can hold; data whose length differs from the shape;
    4. integer ids outside an embedding's rows (``index_ranges``); a non-string ``segment``.
    Triton's own errors are answered with one line: the callable's marker if there is one, else a 5xx without
    the traceback. While Triton restarts (the supervisor), requests wait for it instead of failing.
    """

    def __init__(self, spec: FrontSpec, upstream: Upstream) -> None:
        self.spec = spec
        self.upstream = upstream
        self.max_request_bytes = spec.max_request_bytes
        self.inputs = {s.name: s for s in spec.inputs}
        self.outputs = set(spec.outputs)
        self.ranges = spec.index_ranges
        # JSON headers (of binary requests) that passed every check, with what remains to check of the binary
        # data: see validate().
        self._valid_heads: dict[bytes, tuple[int, list[tuple[str, Any, int, int]]]] = {}
        handler = type("Handler", (_FrontHandler,), {"front": self, "timeout": spec.client_timeout_s})
        host, port = spec.host, spec.http_port
        self._httpd, self._thread = listen_http(host, port, handler, "layerzero-front", f"--port-http {port}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -------------------------------------------------------------------------------------- validation

    def validate(self, model: str, body: bytes, header_length: str | None) -> None:
        """Check one inference request (Case 2-4 of the class doc); raise ``RequestError``."""
        if model != self.spec.model_name:
            raise RequestError(404, f"no model {model[:100]!r}; this server serves {self.spec.model_name!r}")
        if header_length is not None:
            if not header_length.isdigit() or len(header_length) > 12 or int(header_length) > len(body):
                raise RequestError(400, "Inference-Header-Content-Length must be an integer <= the body's length")
            split = int(header_length)
            head, binary = body[:split], body[split:]
            # A client sends the same JSON header with each request of a shape (tritonclient does): every check
            # of Cases 2-3 depends on the header alone, and on the binary data's length, so a header that passed
            # them once is not parsed again; the ids in the binary data are checked each time, in the same order.
            known = self._valid_heads.get(head)
            if known is not None and known[0] == len(binary):
                for name, dtype, count, at in known[1]:
                    self._check_range(name, np.frombuffer(binary, dtype=dtype, count=count, offset=at))
                return
        else:
            head, binary = body, b""
        try:
            doc = json.loads(head)
        except RecursionError:
            raise RequestError(400, "the request JSON is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
            raise RequestError(400, 'the request must be a JSON object with a list "inputs" (KServe v2)')
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise RequestError(400, '"parameters" must be an object')
        segment = params.get("segment")
        if segment is not None and not isinstance(segment, str):
            raise RequestError(400, 'the request parameter "segment" must be a string')
        if REQUEST_ID in params:  # the front's own (it names a request's cached answer): never a client's
            raise RequestError(400, f'the request parameter "{REQUEST_ID}" is reserved')
        outputs = doc.get("outputs", [])
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and o.get("name") in self.outputs
                                                    for o in outputs):  # fmt: skip
            raise RequestError(400, f'"outputs" must name outputs of the model: {sorted(self.outputs)}')
        seen: set[str] = set()
        offset = 0
        ranges: list[tuple[str, Any, int, int]] | None = []  # None: values in the JSON (nothing to remember)
        for tensor in doc["inputs"]:
            if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
                raise RequestError(400, 'each input must be an object with a "name"')
            name = tensor["name"]
            spec = self.inputs.get(name)
            if spec is None:
                raise RequestError(400, f"unknown input {name[:100]!r}; the model's inputs: {sorted(self.inputs)}")
            if name in seen:
                raise RequestError(400, f"input {name!r} is given twice")
            seen.add(name)
            offset = self._check_tensor(spec, tensor, binary, offset, ranges)
            if "data" in tensor:
                ranges = None
        missing = sorted(set(self.inputs) - seen)
        if missing:
            raise RequestError(400, f"missing input(s) {missing}")
        if offset != len(binary):
            raise RequestError(400, f"the binary data holds {len(binary)} bytes, the inputs declare {offset}")
        if ranges is not None and header_length is not None and len(head) <= _HEAD_CACHE_BYTES:
            if len(self._valid_heads) >= _HEAD_CACHE_ENTRIES:
                self._valid_heads.clear()  # clients cycling through many shapes: start again
            self._valid_heads[head] = (offset, ranges)

    def check_shape(self, spec: IOSpec, shape: list[int]) -> int:
        """Check a request's ``shape`` of input ``spec`` (Case 3, for HTTP and gRPC); its number of elements."""
        name = spec.name
        if any(d < 0 for d in shape):
            raise RequestError(400, f"input {name!r}: shape {shape} has a negative dim")
        if len(shape) != len(spec.dims):
            raise RequestError(400, f"input {name!r}: shape {shape} has rank {len(shape)}, the model expects "
                                    f"{len(spec.dims)} (dims {list(spec.dims)}, -1 = any)")  # fmt: skip
        for got, want in zip(shape, spec.dims, strict=True):
            if want > 0 and got != want:
                raise RequestError(400, f"input {name!r}: shape {shape} does not match the model's dims "
                                        f"{list(spec.dims)} (-1 = any)")  # fmt: skip
        # Bounded before any product can grow: each element takes at least one byte of the body.
        count = 1
        for d in shape:
            count *= d
            if count > self.max_request_bytes:
                raise RequestError(400, f"input {name!r}: shape {shape[:8]} has more elements than a request "
                                        f"of at most {self.max_request_bytes} bytes can carry")  # fmt: skip
        if count == 0 and not self._may_be_empty(name, shape):
            raise RequestError(400, f"input {name!r}: shape {shape} is empty (an empty sequence cannot be served)")
        return count

    def _may_be_empty(self, name: str, shape: list[int]) -> bool:
        # A zero only on axes the model takes one on (a KV cache's past on a first step: server.empty_axes).
        axes = self.spec.empty_axes.get(name, ())
        return all(d != 0 or i in axes for i, d in enumerate(shape))

    def _check_tensor(
        self, spec: IOSpec, tensor: dict, binary: bytes, offset: int, ranges: list[tuple[str, Any, int, int]] | None
    ) -> int:
        """Check one input of a request (Case 3-4); the offset of the next input's binary data. The range check
        of binary ids is appended to ``ranges`` (what a known header leaves to check)."""
        name = spec.name
        datatype, itemsize = _KSERVE.get(spec.data_type, (spec.data_type, 0))
        if tensor.get("datatype") != datatype:
            got = str(tensor.get("datatype"))[:40]
            raise RequestError(400, f"input {name!r}: datatype must be {datatype}, got {got!r}")
        shape = tensor.get("shape")
        if (not isinstance(shape, list) or len(shape) > _MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):  # fmt: skip
            raise RequestError(400, f"input {name!r}: shape must be a list of at most {_MAX_RANK} integers")
        count = self.check_shape(spec, shape)
        tparams = tensor.get("parameters", {})
        if not isinstance(tparams, dict):
            raise RequestError(400, f"input {name!r}: parameters must be an object")
        size = tparams.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise RequestError(400, f"input {name!r}: binary_data_size must be a non-negative integer")
            if itemsize and size != count * itemsize:
                raise RequestError(400, f"input {name!r}: binary_data_size {size} != {count} elements × {itemsize}")
            if offset + size > len(binary):
                raise RequestError(400, f"input {name!r}: binary_data_size {size} runs past the body")
            if itemsize and name in self.ranges:
                values = np.frombuffer(binary, dtype=spec.numpy_dtype, count=count, offset=offset)
                self._check_range(name, values)
                if ranges is not None:
                    ranges.append((name, spec.numpy_dtype, count, offset))
            return offset + size
        data = tensor.get("data")
        if not isinstance(data, list):
            raise RequestError(400, f'input {name!r}: "data" must be a list (or use binary_data_size)')
        flat = _flatten(data, name)
        if len(flat) != count:
            raise RequestError(400, f"input {name!r}: {len(flat)} values for shape {shape} ({count} elements)")
        if itemsize:
            kind = np.dtype(spec.numpy_dtype).kind if spec.data_type != "TYPE_BF16" else "f"
            ok = (bool,) if kind == "b" else (int,) if kind in "iu" else (int, float)
            if not all(isinstance(v, ok) and (kind == "b" or not isinstance(v, bool)) for v in flat):
                raise RequestError(400, f"input {name!r}: values must be {datatype} numbers")
            if name in self.ranges:
                self._check_range(name, flat)
        return offset

    def _check_range(self, name: str, values: Any) -> None:
        """Every id in ``values`` (an integer array, or a list of ints from JSON) is in [0, rows)."""
        rows = self.ranges[name]
        if isinstance(values, list):
            # JSON ids are Python ints already (checked): no array to build for a few of them.
            if not values or (min(values) >= 0 and max(values) < rows):
                return
        elif isinstance(values, np.ndarray) and values.dtype.kind == "i":  # noqa: SIM102 (one case per branch)
            # One pass: seen as unsigned, a negative id is above every row count.
            if not values.size or int(values.view(f"u{values.itemsize}").max()) < rows:
                return
        array = np.asarray(values)
        if array.size and (int(array.min()) < 0 or int(array.max()) >= rows):
            bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
            raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self, handler: _FrontHandler, method: str, body: bytes | None, infer: bool = False
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the request to Triton (waiting out a restart) and return its status, headers and body. An
        inference request carries a request id, the same when it is sent again (counted once)."""
        headers = [(k, v) for k, v in handler.headers.items()
                   if k.lower() in ("content-type", "inference-header-content-length", "accept")]  # fmt: skip
        if infer:
            headers.append((REQUEST_ID, self.upstream.next_id()))
        upstream = self.upstream
        deadline = time.monotonic() + self.spec.restart_wait_s
        while True:
            # While the supervisor replaces Triton, wait for it: the request is served late, not lost.
            http_port = upstream.wait(deadline)[0]
            try:
                status, kept, data, close = handler.upstream(http_port).exchange(method, handler.path, headers, body)
                if close:
                    handler.drop_upstream()
                return status, kept, data
            except (ConnectionError, OSError, ValueError):
                # A keep-alive connection Triton closed, or Triton died with this request in flight (the
                # supervisor switches to the standby within ~50 ms): send it again, to whichever serves then.
                handler.drop_upstream()
                if time.monotonic() > deadline or upstream.stopping.is_set():
                    raise RequestError(503, "the inference server is restarting; retry") from None
                time.sleep(0.01)


# ------------------------------------------------------------------------------------------- the gRPC front

_GRPC_SERVICE = "/inference.GRPCInferenceService/"
#: gRPC's own message limit is this far above ``max_request_bytes``: a message in between is refused (and
#: counted) by the front's code with its own one line.
_GRPC_SLACK_BYTES = 1 << 20
#: What the gRPC front forwards: inference and read-only queries. Not the repository (load / unload), shared
#: memory, trace or log settings (as over HTTP, where only inference is POSTed), nor the bidirectional stream.
_GRPC_FORWARDED = frozenset({"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                             "ModelConfig", "ModelStatistics", "ModelInfer"})  # fmt: skip
#: The InferTensorContents field that carries each KServe datatype (FP16 / BF16: raw_input_contents only).
_GRPC_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents", "BYTES": "bytes_contents"}  # fmt: skip


def _grpc_code(status: int) -> Any:
    import grpc

    codes = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
             405: grpc.StatusCode.UNIMPLEMENTED, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
             409: grpc.StatusCode.FAILED_PRECONDITION, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
             503: grpc.StatusCode.UNAVAILABLE}  # fmt: skip
    return codes.get(status, grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL)


class GrpcFront:
    """The gRPC front of Triton's KServe v2 API (``inference.GRPCInferenceService``): the public gRPC port.
    Each ``ModelInfer`` is parsed and validated as the HTTP front validates, then its bytes forwarded as they
    came to Triton's own gRPC port on loopback; the answer's bytes come back as they are.

    Cases refused (a gRPC status with a one-line message, counted in ``layerzero_request_errors_total``):
    1. a message that is not a ``ModelInferRequest`` (INVALID_ARGUMENT); an unknown model (NOT_FOUND);
    2. an unknown or repeated input, a wrong datatype, a shape the model does not take, an empty one (an empty
       sequence), raw contents whose size differs from the shape's, typed contents of the wrong count;
    3. token ids outside an embedding's rows; a ``segment`` parameter that is not a string; unknown outputs;
    4. Triton's own errors: the callable's marker's status and line, or INTERNAL without the traceback.
    5. a message over ``max_request_bytes`` (RESOURCE_EXHAUSTED): gRPC's own limit is set 1 MiB above, so
       such a message reaches this code and is refused here; one larger still is refused by gRPC itself before
       it is read, and counted when its call ends without having reached this code (``_CallWatch``).
    Methods other than inference and read-only queries are UNIMPLEMENTED (not counted: not inference).
    """

    def __init__(self, spec: FrontSpec, upstream: Upstream, http: InferenceFront) -> None:
        import concurrent.futures

        import grpc

        self.spec = spec
        self.upstream = upstream
        self.http = http  # its validation helpers and the model's facts
        self._channels: dict[int, Any] = {}
        self._callables: dict[int, dict[str, Any]] = {}  # by port, then method: read without the lock
        self._lock = threading.Lock()
        workers = max(8, 4 * spec.instances)
        grpc_limit = min(2**31 - 1, spec.max_request_bytes + _GRPC_SLACK_BYTES)
        # so_reuseport 0: gRPC's default lets a second server bind the same port (and steal half the calls).
        options = [("grpc.max_receive_message_length", grpc_limit),
                   ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]  # fmt: skip
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layerzero-grpc"),
            handlers=[_GrpcHandler(self)],
            options=options,
            maximum_concurrent_rpcs=1024,
        )
        host, port = spec.host, spec.grpc_port
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise InvalidInputError(f"--port-grpc {port}: cannot listen on {host}:{port}")

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(5)
        with self._lock:
            channels, self._channels, self._callables = self._channels, {}, {}
        for channel in channels.values():
            channel.close()

    def _callable(self, port: int, method: str) -> Any:
        """The bytes-in, bytes-out callable of ``method`` on the channel to Triton's gRPC ``port``, made once per
        channel and method (making one per call was a tenth of the front's CPU per call)."""
        callables = self._callables.get(port)
        if callables is not None:
            call = callables.get(method)
            if call is not None:
                return call
        import grpc

        with self._lock:
            channel = self._channels.get(port)
            if channel is None:
                for old in self._channels.values():  # a replaced Triton's
                    old.close()
                self._channels, self._callables = {}, {}
                channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])  # fmt: skip
                self._channels[port] = channel
            callables = self._callables.setdefault(port, {})
            call = callables.get(method)
            if call is None:
                call = callables[method] = channel.unary_unary(method)
            return call

    # -------------------------------------------------------------------------------------- validation

    def validate(self, raw: bytes) -> None:
        """Check one ``ModelInferRequest`` (Cases 1-3 of the class doc); raise ``RequestError``."""
        from google.protobuf.message import DecodeError
        from tritonclient.grpc import service_pb2

        front = self.http
        if len(raw) > self.spec.max_request_bytes:
            raise RequestError(413, f"the message is {len(raw)} bytes; at most {self.spec.max_request_bytes} "
                                    "are accepted")  # fmt: skip
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except (DecodeError, RecursionError, ValueError):
            raise RequestError(400, "the message is not a ModelInferRequest") from None
        model = self.spec.model_name
        if request.model_name != model:
            raise RequestError(404, f"no model {request.model_name[:100]!r}; this server serves {model!r}")
        if "segment" in request.parameters and request.parameters["segment"].WhichOneof("parameter_choice") != (
            "string_param"
        ):
            raise RequestError(400, 'the request parameter "segment" must be a string')
        if REQUEST_ID in request.parameters:
            raise RequestError(400, f'the request parameter "{REQUEST_ID}" is reserved')
        for output in request.outputs:
            if output.name not in front.outputs:
                raise RequestError(400, f"outputs must name outputs of the model: {sorted(front.outputs)}")
        raw_contents = request.raw_input_contents  # read in place: no copy of the tensors' bytes
        if raw_contents and len(raw_contents) != len(request.inputs):
            raise RequestError(400, f"{len(raw_contents)} raw_input_contents for {len(request.inputs)} inputs")
        seen: set[str] = set()
        for i, tensor in enumerate(request.inputs):
            spec = front.inputs.get(tensor.name)
            if spec is None:
                raise RequestError(400, f"unknown input {tensor.name[:100]!r}; the model's inputs: "
                                        f"{sorted(front.inputs)}")  # fmt: skip
            if tensor.name in seen:
                raise RequestError(400, f"input {tensor.name!r} is given twice")
            seen.add(tensor.name)
            datatype, itemsize = _KSERVE.get(spec.data_type, (spec.data_type, 0))
            if tensor.datatype != datatype:
                raise RequestError(400, f"input {spec.name!r}: datatype must be {datatype}, got "
                                        f"{tensor.datatype[:40]!r}")  # fmt: skip
            if len(tensor.shape) > _MAX_RANK:
                raise RequestError(400, f"input {spec.name!r}: shape must have at most {_MAX_RANK} dims")
            count = front.check_shape(spec, [int(d) for d in tensor.shape])
            if raw_contents:
                data = raw_contents[i]
                if itemsize and len(data) != count * itemsize:
                    raise RequestError(400, f"input {spec.name!r}: {len(data)} bytes of raw contents != {count} "
                                            f"elements × {itemsize}")  # fmt: skip
                if itemsize and spec.name in front.ranges:
                    front._check_range(spec.name, np.frombuffer(data, dtype=spec.numpy_dtype, count=count))
                continue
            field = _GRPC_CONTENTS.get(datatype)
            values = getattr(tensor.contents, field) if field is not None else ()
            if len(values) != count:
                raise RequestError(400, f"input {spec.name!r}: {len(values)} values for shape {list(tensor.shape)} "
                                        f"({count} elements)")  # fmt: skip
            if spec.name in front.ranges:
                front._check_range(spec.name, np.asarray(values, dtype=np.int64))
        missing = sorted(set(front.inputs) - seen)
        if missing:
            raise RequestError(400, f"missing input(s) {missing}")

    # ------------------------------------------------------------------------------------------ forward

    def call(self, method: str, raw: bytes, context: Any, watch: _CallWatch | None = None) -> bytes:
        """Validate (``ModelInfer``) and forward one unary call; errors end it with a status and one line."""
        import grpc

        infer = method.endswith("/ModelInfer")
        upstream = self.upstream
        if watch is not None:
            watch.reached = True
        if infer:
            upstream.count_request()
        try:
            if infer:
                self.validate(raw)
            return self._forward(method, raw, context, infer)
        except RequestError as e:
            if infer:
                upstream.count_error()
            code, message = _grpc_code(e.status), str(e)
        except _GrpcUpstreamError as e:
            if infer and not e.counted:
                upstream.count_error()
            code, message = e.code, e.message
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("gRPC front: %s failed", method)
            if infer:
                upstream.count_error()
            code, message = grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the server log"
        context.abort(code, _one_line(message))
        raise AssertionError("unreachable: context.abort raises")

    def _forward(self, method: str, raw: bytes, context: Any, infer: bool) -> bytes:
        import grpc

        upstream = self.upstream
        metadata = ((REQUEST_ID, upstream.next_id()),) if infer else None
        deadline = time.monotonic() + self.spec.restart_wait_s
        while True:
            current = upstream.wait(deadline)
            remaining = context.time_remaining()  # no deadline: None, or (some gRPC versions) ~infinite
            if remaining is not None and remaining > 1e6:
                remaining = None
            try:
                return self._callable(current[1], method)(raw, timeout=remaining, metadata=metadata)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and not upstream.alive(current):
                    # Triton died with this call in flight, or is being replaced: send it again.
                    if time.monotonic() > deadline or upstream.stopping.is_set():
                        raise RequestError(503, "the inference server is restarting; retry") from None
                    time.sleep(0.01)
                    continue
                raise _GrpcUpstreamError.of(code, str(e.details() or "")) from None


class _CallWatch:
    """One ``ModelInfer`` call, from its arrival: when it is dropped (the call ended) without having reached
    ``GrpcFront.call``, gRPC refused it itself (a message over its limit, or the client gave up before sending
    it): a request that failed, counted here (Case 5)."""

    __slots__ = ("reached", "upstream")

    def __init__(self, upstream: Upstream) -> None:
        self.reached = False
        self.upstream = upstream

    def __del__(self) -> None:
        if not self.reached:
            with contextlib.suppress(ValueError, TypeError):  # at interpreter exit the mapping may be closed
                self.upstream.count_request()
                self.upstream.count_error()


class _GrpcUpstreamError(Exception):
    """Triton's own gRPC error, made one line (and whether the infer callable counted it already)."""

    def __init__(self, code: Any, message: str, counted: bool) -> None:
        super().__init__(message)
        self.code, self.message, self.counted = code, message, counted

    @classmethod
    def of(cls, code: Any, details: str) -> _GrpcUpstreamError:
        marked = _MARKER.search(details)
        if marked is not None:  # raised (and counted) by the infer callable
            return cls(_grpc_code(int(marked.group(1))), marked.group(2), True)
        if "Traceback" in details or 'File "' in details:
            logger.warning("Triton answered gRPC %s: %s", code, _one_line(details, 2000))
            return cls(code, "inference failed; see the server log", False)
        return cls(code, details.strip().splitlines()[0] if details.strip() else str(code), False)


class _GrpcHandler:
    """Routes every method of the inference service: forwarded ones to ``GrpcFront.call``, bytes in and out."""

    def __init__(self, front: GrpcFront) -> None:
        self.front = front

    def service(self, details: Any) -> Any:
        import grpc

        method = details.method or ""
        name = method[len(_GRPC_SERVICE):] if method.startswith(_GRPC_SERVICE) else None
        if name not in _GRPC_FORWARDED:
            return None  # gRPC answers UNIMPLEMENTED
        if not method.endswith("/ModelInfer"):
            return grpc.unary_unary_rpc_method_handler(lambda raw, context: self.front.call(method, raw, context))
        watch = _CallWatch(self.front.upstream)
        return grpc.unary_unary_rpc_method_handler(lambda raw, context: self.front.call(method, raw, context, watch))


def _flatten(data: list, name: str) -> list:
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) > _MAX_RANK:
                    raise RequestError(400, f"input {name!r}: data is nested deeper than {_MAX_RANK}")
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


class _TritonConnection:
    """A keep-alive HTTP/1.1 connection to Triton's loopback port: the request in one send, the answer's status,
    the headers the front keeps, and its body. Not ``http.client``: its email-parser headers and request
    building were a third of the front's CPU per request; Triton's answers need none of that generality."""

    def __init__(self, port: int, timeout: float = 300.0) -> None:
        self.port = port
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # 64 KiB: Triton's headers and a typical answer's body in one recv, not 8 KiB at a time.
        self._reader = self._sock.makefile("rb", buffering=1 << 16)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
            self._sock.close()

    def exchange(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> tuple[int, list[tuple[str, str]], bytes, bool]:
        """Send one request; its status, kept headers, body and whether Triton closes the connection.

        Raises:
            ConnectionError: Triton closed the connection or answered what is not HTTP/1.x.
        """
        lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}"] + [f"{k}: {v}" for k, v in headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self._sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
        status_line = self._reader.readline(65537)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError("Triton closed the connection" if not status_line else "not an HTTP answer")
        status = int(parts[1])
        kept: list[tuple[str, str]] = []
        length, close, chunked = None, parts[0] == b"HTTP/1.0", False
        for _ in range(200):
            line = self._reader.readline(65537)
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ConnectionError("Triton closed the connection in the headers")
            key, _, value = line.decode("latin-1").partition(":")
            key, value = key.strip(), value.strip()
            low = key.lower()
            if low == "content-length":
                length = int(value)
            elif low == "connection":
                close = value.lower() == "close"
            elif low == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif low in ("content-type", "inference-header-content-length"):
                kept.append((key, value))
        else:
            raise ConnectionError("Triton answered too many headers")
        if method == "HEAD" or status in (204, 304) or status < 200:
            data = b""
        elif chunked:
            chunks = []
            while True:
                size = int(self._reader.readline(65537).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self._reader.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self._read(size))
                self._reader.readline(65537)
            data = b"".join(chunks)
        elif length is not None:
            data = self._read(length)
        else:
            data, close = self._reader.read(), True
        return status, kept, data, close

    def _read(self, n: int) -> bytes:
        data = self._reader.read(n)
        if len(data) < n:
            raise ConnectionError(f"Triton closed the connection after {len(data)} of {n} bytes")
        return data


class _Headers(dict):
    """A request's headers by lower-cased name (the last of repeated ones): what the front reads of them."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().get(key.lower())


_REASONS = {status.value: status.phrase for status in http.HTTPStatus}
_DATE: list[Any] = [0, ""]  # (second, its HTTP date): formatted once a second, not per answer


def _http_date() -> str:
    now = int(time.time())
    second, text = _DATE
    if second != now:
        text = email.utils.formatdate(now, usegmt=True)
        _DATE[:] = [now, text]  # a race writes the same text
    return str(text)


class _BodyReader:
    """Content-Length handling shared by the front and the control server (411 / 400 / 413 / 408), and the
    writing of a whole answer in one send.

    Why one send and TCP_NODELAY: ``BaseHTTPRequestHandler`` writes the headers and the body in two sends; with
    Nagle's algorithm on, the second waits for the ACK of the first, which the client delays (up to 40 ms on
    Linux). That was the front's +18 ms p50 (+38 ms with one client) over bare Triton.
    """

    def setup(self: Any) -> None:
        super().setup()  # type: ignore[misc]
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_whole(self: Any, status: int, headers: list[tuple[str, str]], body: bytes, *, head: bool = False) -> None:
        """The status line, ``headers``, Content-Length and ``body`` (not for HEAD) in one write.

        Built as one string here rather than through ``send_response`` / ``send_header`` (a fifth of the front's
        CPU per request: a call per header, the date formatted each time, the access log line): the same
        status line, ``Server`` and ``Date`` headers as the base class writes, the date formatted once a second.
        """
        if self.request_version != "HTTP/0.9":
            if logger.isEnabledFor(logging.DEBUG):
                self.log_request(status)
            reason = _REASONS.get(status) or self.responses.get(status, ("",))[0]
            lines = [f"{self.protocol_version} {status} {reason}\r\nServer: {self.version_string()}\r\n"
                     f"Date: {_http_date()}\r\n"]  # fmt: skip
            lines += [f"{key}: {value}\r\n" for key, value in headers]
            lines.append(f"Content-Length: {len(body)}\r\n")
            if self.close_connection:
                lines.append("Connection: close\r\n")
            lines.append("\r\n")
            head_bytes = "".join(lines).encode("latin-1", "strict")
            self.wfile.write(head_bytes if head else head_bytes + body)
            return
        self.send_response(status)  # HTTP/0.9 (the base class's parse_request): the body alone, as it writes
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self._headers_buffer.append(b"\r\n")
        if not head:
            self._headers_buffer.append(body)
        self.flush_headers()

    def read_body(self: Any, limit: int) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise RequestError(411, "chunked bodies are not accepted; send a Content-Length")
        text = self.headers.get("Content-Length")
        if text is None:
            if self.command in ("POST", "PUT"):
                raise RequestError(411, "a Content-Length header is required")
            return b""
        text = text.strip()
        if not text.isdigit() or len(text) > 15:
            raise RequestError(400, f"Content-Length {text[:20]!r} is not a non-negative integer")
        length = int(text)
        if length > limit:
            raise RequestError(413, f"the body is {length} bytes; at most {limit} are accepted")
        # A deadline for the whole body, not per read: a client sending a byte every few seconds is cut off.
        deadline = time.monotonic() + float(self.timeout or 30)
        chunks, left = [], length
        # The first read runs under the socket's own timeout (self.timeout, the whole deadline): two fcntl
        # calls per request saved when the body comes at once, as it mostly does.
        first, changed = self.timeout is not None, False
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestError(408, "the request body was not received in time")
            if not first:
                self.connection.settimeout(remaining)
                changed = True
            try:
                chunk = self.rfile.read1(min(left, 1 << 20))
            except (TimeoutError, OSError):
                raise RequestError(408, "the request body was not received in time") from None
            if not chunk:
                raise RequestError(400, f"the body ended after {length - left} of {length} bytes")
            chunks.append(chunk)
            left -= len(chunk)
            first = False
        if changed:
            self.connection.settimeout(self.timeout)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def send_error_line(self: Any, status: int, message: str) -> None:
        if status in (408, 411, 413) or status >= 500:
            self.close_connection = True  # the rest of the body (if any) is not read: do not parse it as a request
        body = (json.dumps({"error": _one_line(message)}) + "\n").encode()
        headers = [("Content-Type", "application/json")]
        if status == 503:  # Triton could not be replaced within restart_wait_s
            headers.append(("Retry-After", "1"))
        try:
            self.send_whole(status, headers, body)
        except OSError:
            self.close_connection = True


class _FrontHandler(_BodyReader, BaseHTTPRequestHandler):
    front: InferenceFront
    protocol_version = "HTTP/1.1"
    _conn: _TritonConnection | None = None

    def upstream(self, port: int) -> _TritonConnection:
        """This client connection's keep-alive connection to Triton (a new one once Triton was replaced)."""
        if self._conn is not None and self._conn.port != port:
            self.drop_upstream()
        if self._conn is None:
            self._conn = _TritonConnection(port)
        return self._conn

    def parse_request(self) -> bool:
        """The request line and headers of a plain HTTP/1.x request, without the email parser (the base
        class's, a sixth of the front's CPU per request); anything else goes to the base class as before."""
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = line.split()
        if len(words) != 3 or words[2] not in ("HTTP/1.1", "HTTP/1.0") or not words[1].startswith("/"):
            return bool(super().parse_request())
        self.requestline, (self.command, self.path, self.request_version) = line, words
        headers = _Headers()
        for _ in range(100):
            raw = self.rfile.readline(65537)
            if len(raw) > 65536:
                self.close_connection = True
                self.send_error_line(431, "a request header is longer than 65536 bytes")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            key, sep, value = raw.decode("iso-8859-1").partition(":")
            if not sep or not key.strip() or key != key.strip():
                self.close_connection = True
                self.send_error_line(400, f"malformed request header {key.strip()[:40]!r}")
                return False
            headers[key.lower()] = value.strip()
        else:
            self.close_connection = True
            self.send_error_line(431, "more than 100 request headers")
            return False
        self.headers = headers  # type: ignore[assignment]
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (self.request_version == "HTTP/1.0"
                                                          and connection != "keep-alive")  # fmt: skip
        expects = headers.get("expect", "").lower() == "100-continue"
        return not expects or bool(self.handle_expect_100())

    def drop_upstream(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def finish(self) -> None:
        self.drop_upstream()
        super().finish()

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._refuse_method()

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    def _refuse_method(self) -> None:
        self.send_error_line(405, f"{self.command} is not served; use GET or POST")

    def _handle(self, method: str) -> None:
        front, upstream = self.front, self.front.upstream
        path = self.path.split("?", 1)[0]
        infer = _INFER_PATH.match(path)
        counted = False
        if infer is not None:
            upstream.count_request()
        try:
            if method == "POST" and infer is None:
                raise RequestError(404, f"POST {path[:100]!r} is not served; inference is POST /v2/models/NAME/infer")
            body = self.read_body(front.max_request_bytes) if method == "POST" else None
            if infer is not None:
                if (self.headers.get("Content-Encoding") or "identity").lower() != "identity":
                    raise RequestError(415, "compressed request bodies are not accepted")
                front.validate(infer.group(1), body or b"", self.headers.get("Inference-Header-Content-Length"))
            status, headers, data = front.forward(self, method, body, infer is not None)
            if status >= 400:
                counted = infer is not None
                status, data, headers = self._rewrite_error(status, data, infer is not None)
            self.send_whole(status, headers, data, head=method == "HEAD")
        except RequestError as e:
            if infer is not None and not counted:
                upstream.count_error()
            self.send_error_line(e.status, str(e))
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("front: %s %s failed", method, path)
            if infer is not None and not counted:
                upstream.count_error()
            self.send_error_line(500, f"internal error ({type(e).__name__}); see the server log")

    def _rewrite_error(self, status: int, data: bytes, infer: bool) -> tuple[int, bytes, list[tuple[str, str]]]:
        # Triton's error bodies carry PyTriton's traceback (and this server's paths): keep one line.
        try:
            text = str(json.loads(data).get("error", ""))
        except (ValueError, AttributeError):
            text = data.decode("utf-8", "replace")
        marked = _MARKER.search(text)
        if marked is not None:  # raised (and counted) by the infer callable
            status, message = int(marked.group(1)), marked.group(2)
        else:
            if infer:
                self.front.upstream.count_error()
            first = text.strip().splitlines()[0] if text.strip() else ""
            if "Traceback" in text or "File \"" in text or status >= 500:
                message = "inference failed; see the server log"
                logger.warning("Triton answered %d: %s", status, _one_line(text, 2000))
            else:
                message = first
        body = (json.dumps({"error": _one_line(message)}) + "\n").encode()
        return status, body, [("Content-Type", "application/json")]

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("front %s - " + format, self.address_string(), *args)


if __name__ == "__main__":
    sys.exit(main())
