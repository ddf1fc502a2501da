"""Serve a guarded engine with Triton Inference Server (PyTriton), plus a control and metrics endpoint.

    server = LayerZeroServer(GuardedEngine(Engine.load("model.lz"), "model.onnx", GuardConfig()))
    with server:                      # starts Triton and the control server, stops both on exit
        server.wait()                 # until SIGINT/SIGTERM (what `layerzero serve` does)

Inference is Triton's own KServe v2 API over HTTP and gRPC (on 127.0.0.1), one model named ``layerzero`` (or
``ServerConfig.model_name``) with the engine's inputs and user outputs (skip masks stripped), dynamic dims -1,
``max_batch_size: 0``, served by ``instances`` Python-backend instances (PyTriton runs the infer function in
this process, one thread per instance; the guard is thread-safe). A request picks its guard segment with the
KServe request parameter ``segment`` (``client.infer(..., parameters={"segment": "chat"})``).

Control is a small HTTP server (stdlib, one thread per connection) on ``control_port``, 127.0.0.1 only,
unauthenticated (bind it to loopback, put a proxy in front for anything else)::

    GET  /metrics                 Prometheus text (ServingMetrics, a registry of this server's own)
    GET  /status                  JSON: model, endpoints, guard state and counters
    GET  /healthz                 "ok" once Triton serves the model
    POST /kill-switch             {"on": true} | {"on": false}   (also POST /kill-switch/on, /kill-switch/off)
    POST /threshold               {"value": 0.05, "segment": "chat"}   (segment optional: the default one)

Why not a ``layerzero_control`` Triton model: control must work while inference is saturated or broken, and
Prometheus scrapes plain HTTP text; a tiny side server gives both with no client library. Triton's own
metrics endpoint is off, so there is one /metrics to scrape.

PyTriton's Python-backend stub links the interpreter's libpython: ``start`` prepends
``sysconfig.get_config_var("LIBDIR")`` to ``LD_LIBRARY_PATH`` for the Triton process it launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import math
import os
import re
import signal
import socket
import sysconfig
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.guard import GuardedEngine
from layerzero.runtime.triton_repo import IOSpec, model_io

if TYPE_CHECKING:  # prometheus_client (the serve extra) is imported when a server is made, not on import
    from layerzero.runtime.metrics import ServingMetrics

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "ControlServer",
    "InferenceFront",
    "LayerZeroServer",
    "RequestError",
    "ServerConfig",
    "index_ranges",
    "pytriton_available",
]

logger = logging.getLogger(__name__)


def pytriton_available() -> bool:
    """Whether PyTriton can be imported (``pip install 'layerzero[serve]'``)."""
    try:
        import pytriton.triton  # noqa: F401
    except Exception:
        return False
    return True


#: The default cap of one inference request's body over HTTP (``--max-request-bytes``).
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: Tries to start (or restart) Triton before giving up.
_START_ATTEMPTS = 5
#: The cap of a control request's body: its JSON documents are a few bytes.
CONTROL_MAX_BODY_BYTES = 64 * 1024


@dataclasses.dataclass
class ServerConfig:
    """Where and how to serve. Triton needs fixed ports; ``control_port`` 0 picks a free one.

    ``max_request_bytes`` caps an inference request's body; ``client_timeout_s`` is how long a client may take
    to send one request (slow clients are cut off); ``restart_wait_s`` how long a request waits for Triton to
    come back after the supervisor restarted it.
    """

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    control_port: int = 8002
    model_name: str = "layerzero"
    instances: int = 2
    exit_timeout_s: int = 5
    log_verbose: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    client_timeout_s: float = 30.0
    restart_wait_s: float = 60.0


class LayerZeroServer:
    """Triton (via PyTriton) serving a ``GuardedEngine``, and the control server. See the module doc."""

    def __init__(
        self,
        guard: GuardedEngine,
        config: ServerConfig | None = None,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.guard = guard
        self.config = config or ServerConfig()
        if metrics is None:
            from layerzero.runtime.metrics import ServingMetrics

            metrics = ServingMetrics(guard)
        self.metrics = metrics
        inputs, outputs = model_io(guard.engine.model_path)
        self._inputs = inputs
        names = set(guard.output_names)
        self._outputs = [o for o in outputs if o.name in names]
        self._output_names = [o.name for o in self._outputs]
        self._index_ranges = index_ranges(guard.engine.model_path)
        self._triton: Any = None
        self._control: ControlServer | None = None
        self._front: InferenceFront | None = None
        self._supervisor: threading.Thread | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self.restarts = 0  # times the supervisor restarted Triton
        self._triton_ready = threading.Event()  # cleared while the supervisor restarts Triton
        self._fatal: str | None = None

    # ---------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the control server, the HTTP front, then Triton (on a loopback port of its own) and its
        supervisor; returns once Triton serves the model."""
        if not pytriton_available():
            raise LayerZeroError("serving needs PyTriton: pip install 'layerzero[serve]'")
        _libpython_on_library_path()
        cfg = self.config
        if len({cfg.http_port, cfg.grpc_port, cfg.control_port}) < 3:
            raise InvalidInputError(f"the HTTP, gRPC and control ports must differ, got {cfg.http_port}, "
                                    f"{cfg.grpc_port}, {cfg.control_port}")  # fmt: skip
        # Triton does not report a busy port to PyTriton, which then waits for it forever: check first.
        for what, port in (("--port-http", cfg.http_port), ("--port-grpc", cfg.grpc_port)):
            _check_port_free(cfg.host, port, what)
        if self.guard.has_reference:
            # Load (and so check) the reference now: a broken one must fail the start, not the first request
            # that samples or the first time someone turns the kill switch on.
            try:
                self.guard.preload_reference()
            except LayerZeroError:
                raise
            except Exception as e:
                raise InvalidInputError(f"the reference model cannot be loaded: {_one_line(str(e), 200)}") from None
        self._started = time.monotonic()
        try:
            self._control = ControlServer(self, cfg.host, cfg.control_port)
            self._control.start()
            self._front = InferenceFront(self, cfg.host, cfg.http_port)
            self._front.start()
            # PyTriton's handshake with its Python-backend stubs has a fixed 1 s timeout, which a loaded machine
            # misses now and then: try a few times, a little apart.
            for attempt in range(_START_ATTEMPTS):
                try:
                    self._triton = self._start_triton()
                    self._triton_ready.set()
                    break
                except Exception as e:
                    if attempt == _START_ATTEMPTS - 1:
                        message = f"Triton Inference Server did not start: {_one_line(str(e), 300)}"
                        raise LayerZeroError(message) from None
                    logger.warning("Triton did not start (%s); trying again", _one_line(str(e), 200))
                    time.sleep(1.0 + attempt)
        except Exception:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="layerzero-supervisor", daemon=True)
        self._supervisor.start()
        self._control.ready = True
        logger.info("serving %s: %s", cfg.model_name, self.endpoints())

    def _start_triton(self) -> Any:
        from pytriton.model_config import ModelConfig
        from pytriton.triton import Triton, TritonConfig

        cfg = self.config
        assert self._front is not None
        self._front.upstream_port = _free_port("127.0.0.1")
        triton_config = TritonConfig(
            http_address="127.0.0.1",  # only the front talks HTTP to Triton
            http_port=self._front.upstream_port,
            grpc_address=cfg.host,
            grpc_port=cfg.grpc_port,
            allow_metrics=False,
            exit_timeout_secs=cfg.exit_timeout_s,
            log_verbose=cfg.log_verbose,
        )
        triton = Triton(config=triton_config)
        try:
            triton.bind(
                model_name=cfg.model_name,
                infer_func=[self._infer] * max(1, cfg.instances),
                inputs=[_tensor(s) for s in self._inputs],
                outputs=[_tensor(s) for s in self._outputs],
                config=ModelConfig(batching=False),
                strict=False,
            )
            triton.run()
        except Exception:
            with contextlib.suppress(Exception):
                triton.stop()
            raise
        return triton

    def _supervise(self) -> None:
        """Restart Triton when it dies (whatever killed it); requests meanwhile wait in the front."""
        failures = 0
        while not self._stop.wait(0.1):
            triton = self._triton
            if triton is None or triton.is_alive():
                continue
            self._triton_ready.clear()
            logger.error("Triton Inference Server exited unexpectedly; restarting it")
            with contextlib.suppress(Exception):
                triton.stop()
            # PyTriton's own exit callback tears the old workspace and proxies down in another thread: give
            # it a moment, or the new stubs' handshake races it (and, on a loaded machine, times out).
            if self._stop.wait(1.0):
                return
            try:
                self._triton = self._start_triton()
                self._triton_ready.set()
                self.restarts += 1
                failures = 0
                logger.warning("Triton Inference Server restarted (%d restart(s) so far)", self.restarts)
            except Exception as e:
                failures += 1
                logger.error("restarting Triton failed (%d): %s", failures, _one_line(str(e), 300))
                if failures >= _START_ATTEMPTS:
                    self._fatal = f"Triton Inference Server could not be restarted: {_one_line(str(e), 200)}"
                    self._stop.set()
                    return

    def stop(self) -> None:
        """Stop Triton, the front and the control server (idempotent)."""
        self._stop.set()
        if self._control is not None:
            self._control.ready = False
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=60)
        triton, self._triton = self._triton, None
        if triton is not None:
            with contextlib.suppress(Exception):
                triton.stop()
        front, self._front = self._front, None
        if front is not None:
            front.stop()
        control, self._control = self._control, None
        if control is not None:
            control.stop()

    def wait(self) -> None:
        """Block until SIGINT/SIGTERM (main thread) or ``stop()``; raise if Triton died and could not be
        restarted."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(0.5):
            pass
        if self._fatal is not None:
            raise LayerZeroError(self._fatal)

    @property
    def triton_pid(self) -> int | None:
        """The tritonserver process id (for the supervisor's tests), when PyTriton exposes it."""
        server = getattr(self._triton, "_triton_server", None)
        cmd = getattr(server, "_tritonserver_running_cmd", None)
        return getattr(cmd, "pid", None)

    def __enter__(self) -> LayerZeroServer:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- status

    @property
    def control_port(self) -> int:
        return self._control.port if self._control is not None else self.config.control_port

    def endpoints(self) -> dict[str, str]:
        cfg = self.config
        return {
            "http": f"{cfg.host}:{cfg.http_port}",
            "grpc": f"{cfg.host}:{cfg.grpc_port}",
            "control": f"http://{cfg.host}:{self.control_port}",
        }

    def status(self) -> dict[str, Any]:
        engine = self.guard.engine
        return {
            "model": self.config.model_name,
            "bundle": str(engine.path),
            "ready": self._control is not None and self._control.ready,
            "uptime_s": round(time.monotonic() - self._started, 3) if self._started else 0.0,
            "endpoints": self.endpoints(),
            "inputs": [dataclasses.asdict(s) for s in self._inputs],
            "outputs": [dataclasses.asdict(s) for s in self._outputs],
            "guard": self.guard.stats(),
            "triton_restarts": self.restarts,
            "max_request_bytes": self.config.max_request_bytes,
        }

    # -------------------------------------------------------------------------------------------- infer

    def _infer(self, requests: list) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            started = time.perf_counter()
            try:
                params = getattr(request, "parameters", None) or {}
                segment = params.get("segment")
                if segment is not None and not isinstance(segment, str):
                    raise RequestError(400, 'the request parameter "segment" must be a string')
                self._check_feeds(request.data)
                result = self.guard.run(request.data, segment=segment)
            except Exception as e:
                # Counted here, marked for the front, which answers the status and the line (no traceback).
                self.metrics.observe_error()
                if isinstance(e, RequestError):
                    status, message = e.status, str(e)
                elif isinstance(e, InvalidInputError):
                    status, message = 400, str(e)
                elif isinstance(e, LayerZeroError):
                    status, message = 409, str(e)
                else:
                    logger.exception("inference failed")
                    status, message = 500, f"inference failed ({type(e).__name__}); see the server log"
                # No server paths in an answer to a client: the bundle is named, not where it lies.
                bundle = self.guard.engine.path
                message = message.replace(str(Path(bundle).parent) + os.sep, "").replace(str(bundle), Path(bundle).name)
                raise RuntimeError(f"[layerzero {status}] {_one_line(message)}") from None
            self.metrics.observe(result, time.perf_counter() - started)
            responses.append({name: result.outputs[name] for name in self._output_names})
        return responses

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        # What the front checks for HTTP, again for gRPC (which reaches Triton directly).
        for name, value in feeds.items():
            array = np.asarray(value)
            if array.size == 0:
                raise RequestError(400, f"input {name!r}: shape {list(array.shape)} is empty "
                                        "(an empty sequence cannot be served)")  # fmt: skip
            rows = self._index_ranges.get(name)
            if rows is not None and array.dtype.kind in "iu" and (int(array.min()) < 0 or int(array.max()) >= rows):
                bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
                raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")


# ------------------------------------------------------------------------------------------------ the front


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


def _one_line(message: str, limit: int = 400) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def index_ranges(model_path: str | os.PathLike[str]) -> dict[str, int]:
    """Integer inputs used only as row indices of a weight (``Gather(W, ids)``, an embedding): name -> rows.

    What a token id may be: ``0 <= id < rows``. Weights are not loaded (dims only).
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    rows = {t.name: t.dims[0] for t in graph.initializer if len(t.dims) >= 1}
    ints = {v.name for v in graph.input if v.type.tensor_type.elem_type in (2, 3, 4, 5, 6, 7, 12, 13)} - set(rows)
    ranges: dict[str, int] = {}
    for name in ints:
        uses = [n for n in graph.node if name in n.input]
        limits = []
        for node in uses:
            if node.op_type in ("Shape", "Size"):  # reads the ids' shape, not their values
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if node.op_type != "Gather" or axis != 0 or list(node.input).index(name) != 1 or node.input[0] not in rows:
                break
            limits.append(rows[node.input[0]])
        else:
            if limits:
                ranges[name] = min(limits)
    return ranges


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

    def __init__(self, server: LayerZeroServer, host: str, port: int) -> None:
        self.lz = server
        cfg = server.config
        self.max_request_bytes = cfg.max_request_bytes
        self.inputs = {s.name: s for s in server._inputs}
        self.outputs = set(server._output_names)
        self.ranges = server._index_ranges
        self.upstream_port = 0  # Triton's own HTTP port, set by the server before it serves
        handler = type("Handler", (_FrontHandler,), {"front": self, "timeout": cfg.client_timeout_s})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise InvalidInputError(f"--port-http {port}: cannot listen on {host}:{port}: {e.strerror}") from e
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="layerzero-front", daemon=True)  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -------------------------------------------------------------------------------------- validation

    def validate(self, model: str, body: bytes, header_length: str | None) -> None:
        """Check one inference request (Case 2-4 of the class doc); raise ``RequestError``."""
        if model != self.lz.config.model_name:
            raise RequestError(404, f"no model {model[:100]!r}; this server serves {self.lz.config.model_name!r}")
        if header_length is not None:
            if not header_length.isdigit() or len(header_length) > 12 or int(header_length) > len(body):
                raise RequestError(400, "Inference-Header-Content-Length must be an integer <= the body's length")
            split = int(header_length)
            head, binary = body[:split], body[split:]
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
        outputs = doc.get("outputs", [])
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and o.get("name") in self.outputs
                                                    for o in outputs):  # fmt: skip
            raise RequestError(400, f'"outputs" must name outputs of the model: {sorted(self.outputs)}')
        seen: set[str] = set()
        offset = 0
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
            offset = self._check_tensor(spec, tensor, binary, offset)
        missing = sorted(set(self.inputs) - seen)
        if missing:
            raise RequestError(400, f"missing input(s) {missing}")
        if offset != len(binary):
            raise RequestError(400, f"the binary data holds {len(binary)} bytes, the inputs declare {offset}")

    def _check_tensor(self, spec: IOSpec, tensor: dict, binary: bytes, offset: int) -> int:
        name = spec.name
        datatype, itemsize = _KSERVE.get(spec.data_type, (spec.data_type, 0))
        if tensor.get("datatype") != datatype:
            got = str(tensor.get("datatype"))[:40]
            raise RequestError(400, f"input {name!r}: datatype must be {datatype}, got {got!r}")
        shape = tensor.get("shape")
        if (not isinstance(shape, list) or len(shape) > _MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):  # fmt: skip
            raise RequestError(400, f"input {name!r}: shape must be a list of at most {_MAX_RANK} integers")
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
        if count == 0:
            raise RequestError(400, f"input {name!r}: shape {shape} is empty (an empty sequence cannot be served)")
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
        rows = self.ranges[name]
        array = np.asarray(values)
        if array.size and (int(array.min()) < 0 or int(array.max()) >= rows):
            bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
            raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self, handler: _FrontHandler, method: str, body: bytes | None
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the request to Triton (waiting out a restart) and return its status, headers and body."""
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() in ("content-type", "inference-header-content-length", "accept")}  # fmt: skip
        deadline = time.monotonic() + self.lz.config.restart_wait_s
        while True:
            # While the supervisor restarts Triton, wait for it: the request is served late, not lost.
            if not self.lz._triton_ready.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise RequestError(503, "the inference server is restarting; retry")
            conn = handler.upstream(self.upstream_port)
            try:
                conn.request(method, handler.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                kept = [(k, v) for k, v in response.getheaders()
                        if k.lower() in ("content-type", "inference-header-content-length")]  # fmt: skip
                return response.status, kept, data
            except (ConnectionError, http.client.HTTPException, OSError):
                handler.drop_upstream()
                if self.lz._triton_ready.is_set() and self.lz._triton is not None and self.lz._triton.is_alive():
                    time.sleep(0.05)  # Triton is up: a dropped keep-alive connection; retry at once
                # Triton died (a restart is under way) or is not up yet: wait for it rather than fail the request.
                if time.monotonic() > deadline or self.lz._stop.is_set():
                    raise RequestError(503, "the inference server is restarting; retry") from None
                time.sleep(0.05)


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


class _BodyReader:
    """Content-Length handling shared by the front and the control server (411 / 400 / 413 / 408)."""

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
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestError(408, "the request body was not received in time")
            self.connection.settimeout(remaining)
            try:
                chunk = self.rfile.read1(min(left, 1 << 20))
            except (TimeoutError, OSError):
                raise RequestError(408, "the request body was not received in time") from None
            if not chunk:
                raise RequestError(400, f"the body ended after {length - left} of {length} bytes")
            chunks.append(chunk)
            left -= len(chunk)
        self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def send_error_line(self: Any, status: int, message: str) -> None:
        if status in (408, 411, 413) or status >= 500:
            self.close_connection = True  # the rest of the body (if any) is not read: do not parse it as a request
        body = (json.dumps({"error": _one_line(message)}) + "\n").encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


class _FrontHandler(_BodyReader, BaseHTTPRequestHandler):
    front: InferenceFront
    protocol_version = "HTTP/1.1"
    _conn: http.client.HTTPConnection | None = None

    def upstream(self, port: int) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        return self._conn

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
        front, lz = self.front, self.front.lz
        path = self.path.split("?", 1)[0]
        infer = _INFER_PATH.match(path)
        counted = False
        try:
            if method == "POST" and infer is None:
                raise RequestError(404, f"POST {path[:100]!r} is not served; inference is POST /v2/models/NAME/infer")
            body = self.read_body(front.max_request_bytes) if method == "POST" else None
            if infer is not None:
                if (self.headers.get("Content-Encoding") or "identity").lower() != "identity":
                    raise RequestError(415, "compressed request bodies are not accepted")
                front.validate(infer.group(1), body or b"", self.headers.get("Inference-Header-Content-Length"))
            status, headers, data = front.forward(self, method, body)
            if status >= 400:
                counted = infer is not None
                status, data, headers = self._rewrite_error(status, data, infer is not None)
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)
        except RequestError as e:
            if infer is not None and not counted:
                lz.metrics.observe_error()
            self.send_error_line(e.status, str(e))
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("front: %s %s failed", method, path)
            if infer is not None and not counted:
                lz.metrics.observe_error()
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
                self.front.lz.metrics.observe_error()
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



class ControlServer:
    """The control + metrics HTTP server of a ``LayerZeroServer`` (see the module doc for its endpoints)."""

    def __init__(self, server: LayerZeroServer, host: str, port: int) -> None:
        self.ready = False
        timeout = min(10.0, server.config.client_timeout_s)
        handler = type("Handler", (_ControlHandler,), {"lz": server, "control": self, "timeout": timeout})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise InvalidInputError(f"cannot listen on {host}:{port} for control and /metrics: {e.strerror}") from e
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="layerzero-control", daemon=True)  # fmt: skip

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _ControlHandler(_BodyReader, BaseHTTPRequestHandler):
    """Every request is answered: 200, or 400/404/405/408/411/413/409 with a one-line JSON error."""

    lz: LayerZeroServer
    control: ControlServer
    protocol_version = "HTTP/1.1"
    timeout = 10.0  # a client that takes longer to send its request is cut off

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def do_PUT(self) -> None:
        self.send_error_line(405, f"{self.command} is not served; GET /metrics /status /healthz, POST /kill-switch "
                                  "/threshold")  # fmt: skip

    do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_PUT

    def _guarded(self, handle: Any) -> None:
        try:
            handle()
        except RequestError as e:
            self.send_error_line(e.status, str(e))
        except InvalidInputError as e:
            self.send_error_line(400, str(e))
        except LayerZeroError as e:
            self.send_error_line(409, str(e))
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("control: %s %s failed", self.command, self.path[:200])
            self.send_error_line(500, f"internal error ({type(e).__name__}); see the server log")

    def _get(self) -> None:
        self.read_body(CONTROL_MAX_BODY_BYTES)  # consumed (and capped) so that keep-alive stays in step
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/metrics":
            from layerzero.runtime.metrics import CONTENT_TYPE

            self._send(HTTPStatus.OK, self.lz.metrics.render(), CONTENT_TYPE)
        elif path == "/status":
            self._json(HTTPStatus.OK, self.lz.status())
        elif path == "/healthz":
            ok = self.control.ready
            self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, b"ok\n" if ok else b"starting\n")
        else:
            raise RequestError(404, f"no such endpoint {self.path[:100]!r}; see GET /status")

    def _post(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        body = self._body()
        guard = self.lz.guard
        if path in ("/kill-switch", "/kill-switch/on", "/kill-switch/off"):
            on = path.endswith("/on") if path != "/kill-switch" else body.get("on")
            if not isinstance(on, bool):
                raise InvalidInputError('POST /kill-switch needs a JSON body {"on": true|false}')
            if on:
                guard.preload_reference()  # checked at start; loads nothing new here
            guard.set_kill_switch(on)
            self._json(HTTPStatus.OK, {"kill_switch": guard.kill_switch})
        elif path == "/threshold":
            value, segment = body.get("value"), body.get("segment")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInputError('POST /threshold needs a JSON body {"value": 0.05, "segment": optional}')
            try:
                number = float(value)
            except OverflowError:  # a 300-digit integer
                raise InvalidInputError(f"POST /threshold: value {str(value)[:20]}... is out of range [0, 1]") from None
            if not math.isfinite(number) or not 0.0 <= number <= 1.0:
                raise InvalidInputError(f"POST /threshold: value {number!r} is out of range [0, 1]")
            if segment is not None and not isinstance(segment, str):
                raise InvalidInputError('POST /threshold: "segment" must be a string (a segment name)')
            guard.set_threshold(number, segment)
            self._json(HTTPStatus.OK, {"segment": segment, "threshold": guard.threshold(segment),
                                       "effective": guard.has_threshold_input})  # fmt: skip
        else:
            raise RequestError(404, f"no such endpoint {self.path[:100]!r}")

    def _body(self) -> dict[str, Any]:
        raw = self.read_body(CONTROL_MAX_BODY_BYTES)
        if not raw:
            return {}
        try:
            doc = json.loads(raw)
        except RecursionError:
            raise InvalidInputError("the request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"the request body is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise InvalidInputError("the request body must be a JSON object")
        return doc

    def _json(self, status: HTTPStatus, doc: Any) -> None:
        self._send(status, (json.dumps(doc) + "\n").encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("control %s - " + format, self.address_string(), *args)




def _tensor(spec: IOSpec) -> Any:
    from pytriton.model_config import Tensor

    dtype = spec.numpy_dtype
    if dtype is None:
        raise InvalidInputError(f"{spec.name!r}: {spec.data_type} cannot be served through PyTriton")
    return Tensor(name=spec.name, dtype=dtype, shape=spec.dims or (1,))


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket() as probe:
        # As Triton does: a port held only by TIME_WAIT connections is free; one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise InvalidInputError(f"{what} {port}: cannot listen on {host}:{port}: {e.strerror}") from e


def _libpython_on_library_path() -> None:
    # Also the wheel's bundled libraries (libcudart, ...): PyTriton copies tritonserver into a workspace, where
    # the binary's relative RPATH to nvidia_pytriton.libs no longer resolves.
    import pytriton

    bundled = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    for libdir in (sysconfig.get_config_var("LIBDIR"), str(bundled) if bundled.is_dir() else None):
        if not libdir:
            continue
        current = os.environ.get("LD_LIBRARY_PATH", "")
        if libdir not in current.split(os.pathsep):
            os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, current) if p)
