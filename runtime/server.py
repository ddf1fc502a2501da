"""Serve a guarded engine with Triton Inference Server (PyTriton), plus a control and metrics endpoint.

    server = LayerZeroServer(GuardedEngine(Engine.load("model.lz"), "model.onnx", GuardConfig()))
    with server:                      # starts Triton and the control server, stops both on exit
        server.wait()                 # until SIGINT/SIGTERM (what `layerzero serve` does)

Inference is Triton's own KServe v2 API over HTTP and gRPC (on 127.0.0.1), one model named ``layerzero`` (or
``ServerConfig.model_name``) with the engine's inputs and user outputs (skip masks stripped), dynamic dims -1,
``max_batch_size: 0``, served by ``instances`` Python-backend instances (PyTriton runs the infer function in
this process, one thread per instance; the guard is thread-safe). A request picks its guard segment with the
KServe request parameter ``segment`` (``client.infer(..., parameters={"segment": "chat"})``).

The public HTTP and gRPC ports are this process's fronts (``InferenceFront``, ``GrpcFront``): each request is
validated before Triton parses it, then its bytes are forwarded over keep-alive connections to Triton, which
listens on loopback ports of its own (metrics, SageMaker, Vertex AI off). A standby Triton is kept started:
when the serving one dies the supervisor switches the fronts to it (tens of ms; requests wait, those in
flight are sent again) and starts the next standby.

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
    "GrpcFront",
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
    come back after the supervisor restarted it. ``grpc`` False: no gRPC port at all. ``standby``: a second
    Triton is kept started and idle, so that a dead one is replaced in milliseconds, not a cold start.
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
    grpc: bool = True
    standby: bool = True


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
        self._active: _TritonInstance | None = None  # the Triton the fronts forward to
        self._standby: _TritonInstance | None = None  # started, idle, takes over when the active one dies
        self._standby_thread: threading.Thread | None = None
        self._control: ControlServer | None = None
        self._front: InferenceFront | None = None
        self._grpc_front: GrpcFront | None = None
        self._supervisor: threading.Thread | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self.restarts = 0  # times the supervisor restarted Triton
        self.last_restart_s: float | None = None  # how long the last one left the fronts without a Triton
        self._triton_ready = threading.Event()  # cleared while the supervisor restarts Triton
        self._fatal: str | None = None

    # ---------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the control server, the HTTP (and gRPC) front, then Triton (on loopback ports of its own) and
        its supervisor; returns once Triton serves the model. The standby Triton starts in the background."""
        if not pytriton_available():
            raise LayerZeroError("serving needs PyTriton: pip install 'layerzero[serve]'")
        _libpython_on_library_path()
        _patch_pytriton_handshake()
        cfg = self.config
        if len({cfg.http_port, cfg.grpc_port, cfg.control_port}) < 3:
            raise InvalidInputError(f"the HTTP, gRPC and control ports must differ, got {cfg.http_port}, "
                                    f"{cfg.grpc_port}, {cfg.control_port}")  # fmt: skip
        for what, port in (("--port-http", cfg.http_port), ("--port-grpc", cfg.grpc_port))[: 2 if cfg.grpc else 1]:
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
            if cfg.grpc:
                self._grpc_front = GrpcFront(self, cfg.host, cfg.grpc_port)
                self._grpc_front.start()
            self._active = self._start_triton_retrying()
            self._triton_ready.set()
        except Exception:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="layerzero-supervisor", daemon=True)
        self._supervisor.start()
        if cfg.standby:
            self._standby_thread = threading.Thread(target=self._standby_loop, name="layerzero-standby", daemon=True)
            self._standby_thread.start()
        self._control.ready = True
        logger.info("serving %s: %s", cfg.model_name, self.endpoints())

    def _start_triton_retrying(self) -> _TritonInstance:
        # PyTriton's handshake with its Python-backend stubs has a fixed 1 s timeout, which a loaded machine
        # misses now and then: try a few times, a little apart.
        for attempt in range(_START_ATTEMPTS):
            if self._stop.is_set() and attempt:
                break
            try:
                return self._start_triton()
            except Exception as e:
                if attempt == _START_ATTEMPTS - 1:
                    raise LayerZeroError(f"Triton Inference Server did not start: {_one_line(str(e), 300)}") from None
                logger.warning("Triton did not start (%s); trying again", _one_line(str(e), 200))
                time.sleep(1.0 + attempt)
        raise LayerZeroError("Triton Inference Server did not start: the server is stopping")

    def _start_triton(self) -> _TritonInstance:
        """A Triton serving the model, its HTTP and gRPC on free 127.0.0.1 ports: only the fronts talk to it."""
        from pytriton.model_config import ModelConfig
        from pytriton.triton import Triton, TritonConfig

        cfg = self.config
        http_port, grpc_port = _free_ports("127.0.0.1", 2)
        triton_config = TritonConfig(
            http_address="127.0.0.1",
            http_port=http_port,
            grpc_address="127.0.0.1",
            grpc_port=grpc_port,
            allow_metrics=False,
            allow_sagemaker=False,
            allow_vertex_ai=False,
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
        return _TritonInstance(triton, http_port, grpc_port)

    def _supervise(self) -> None:
        """Replace Triton when it dies (whatever killed it): by the standby at once when there is one (or as soon
        as the one being started is up), else by a cold start; requests meanwhile wait in the fronts (or are sent
        again, the ones in flight) and are not lost."""
        failures = 0
        while not self._stop.wait(0.05):
            active = self._active
            if active is not None and active.alive():
                continue
            died = time.monotonic()
            self._triton_ready.clear()
            logger.error("Triton Inference Server exited unexpectedly; replacing it")
            if active is not None:
                self._active = None
                _retire(active)
            if self.config.standby:
                # The standby thread keeps one started; wait for it (it is usually up already).
                while not self._stop.is_set():
                    standby, self._standby = self._standby, None
                    if standby is not None and standby.alive():
                        self._active = standby
                        self._record_restart(died, "the standby took over")
                        break
                    if standby is not None:
                        _retire(standby)
                    self._stop.wait(0.01)
                continue
            # A cold start. PyTriton's own exit callback tears the old workspace down in another thread: give it
            # a moment, or the new stubs' handshake races it.
            if self._stop.wait(1.0):
                return
            try:
                self._active = self._start_triton()  # NOTE: in this long-lived thread (see _standby_loop)
                self._record_restart(died, "cold start")
                failures = 0
            except Exception as e:
                failures += 1
                logger.error("restarting Triton failed (%d): %s", failures, _one_line(str(e), 300))
                if failures >= _START_ATTEMPTS:
                    self._fatal = f"Triton Inference Server could not be restarted: {_one_line(str(e), 200)}"
                    self._stop.set()
                    return

    def _record_restart(self, died: float, how: str) -> None:
        self._triton_ready.set()
        self.restarts += 1
        self.last_restart_s = time.monotonic() - died
        logger.warning("Triton Inference Server replaced in %.3f s (%s; %d restart(s) so far)",
                       self.last_restart_s, how, self.restarts)  # fmt: skip

    def _standby_loop(self) -> None:
        """Keep a standby Triton started and idle (a new one after it took over or died).

        NOTE: a thread of its own that lives as long as the server: PyTriton starts tritonserver with
        PR_SET_PDEATHSIG, which Linux fires when the *thread* that forked it exits, not the process; a
        standby started from a short-lived thread is SIGTERMed as that thread ends.
        """
        backoff = 2.0
        while not self._stop.wait(0.05):
            standby = self._standby
            if standby is not None:
                if standby.alive():
                    continue
                self._standby = None
                _retire(standby)
            try:
                instance = self._start_triton()
            except Exception as e:
                # Each try costs seconds of CPU: back off (to a minute) rather than compete with serving.
                logger.warning("the standby Triton did not start (%s); trying again in %.0f s",
                               _one_line(str(e), 200), backoff)  # fmt: skip
                if self._stop.wait(backoff):
                    return
                backoff = min(60.0, backoff * 2)
                continue
            backoff = 2.0
            if self._stop.is_set():
                _retire(instance, wait=True)
                return
            self._standby = instance
            logger.info("standby Triton ready (pid %s)", instance.pid)

    def stop(self) -> None:
        """Stop Triton (and its standby), the fronts and the control server (idempotent)."""
        self._stop.set()
        if self._control is not None:
            self._control.ready = False
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=60)
        standby_thread, self._standby_thread = self._standby_thread, None
        if standby_thread is not None and standby_thread is not threading.current_thread():
            standby_thread.join(timeout=120)  # a start under way finishes, then is stopped
        for instance in (self._active, self._standby):
            if instance is not None:
                _retire(instance, wait=True)
        self._active = self._standby = None
        for front in (self._grpc_front, self._front):
            if front is not None:
                front.stop()
        self._front = self._grpc_front = None
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
        """The serving tritonserver's process id (for the supervisor's tests), when PyTriton exposes it."""
        return self._active.pid if self._active is not None else None

    @property
    def standby_pid(self) -> int | None:
        """The standby tritonserver's process id, once it has started."""
        return self._standby.pid if self._standby is not None else None

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
            **({"grpc": f"{cfg.host}:{cfg.grpc_port}"} if cfg.grpc else {}),
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
            "triton": self._active.describe() if self._active is not None else None,
            "triton_restarts": self.restarts,
            "last_restart_s": self.last_restart_s,
            "standby_ready": self._standby is not None,
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
        if count == 0:
            raise RequestError(400, f"input {name!r}: shape {shape} is empty (an empty sequence cannot be served)")
        return count

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
        headers = [(k, v) for k, v in handler.headers.items()
                   if k.lower() in ("content-type", "inference-header-content-length", "accept")]  # fmt: skip
        deadline = time.monotonic() + self.lz.config.restart_wait_s
        while True:
            # While the supervisor replaces Triton, wait for it: the request is served late, not lost.
            lz = self.lz
            if not lz._triton_ready.wait(timeout=max(0.0, deadline - time.monotonic())) or lz._stop.is_set():
                raise RequestError(503, "the inference server is restarting; retry")
            active = lz._active
            if active is None:
                time.sleep(0.005)
                continue
            try:
                status, kept, data, close = handler.upstream(active.http_port).exchange(
                    method, handler.path, headers, body
                )
                if close:
                    handler.drop_upstream()
                return status, kept, data
            except (ConnectionError, OSError, ValueError):
                # A keep-alive connection Triton closed, or Triton died with this request in flight (the
                # supervisor switches to the standby within ~50 ms): send it again, to whichever serves then.
                handler.drop_upstream()
                if time.monotonic() > deadline or lz._stop.is_set():
                    raise RequestError(503, "the inference server is restarting; retry") from None
                time.sleep(0.01)


# ------------------------------------------------------------------------------------------- the gRPC front

_GRPC_SERVICE = "/inference.GRPCInferenceService/"
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
    Methods other than inference and read-only queries are UNIMPLEMENTED (not counted: not inference). A
    message over ``max_request_bytes`` is refused by gRPC itself (RESOURCE_EXHAUSTED) before it is read, so
    it is not counted either.
    """

    def __init__(self, server: LayerZeroServer, host: str, port: int) -> None:
        import concurrent.futures

        import grpc

        self.lz = server
        self._channels: dict[int, Any] = {}
        self._lock = threading.Lock()
        workers = max(8, 4 * server.config.instances)
        # so_reuseport 0: gRPC's default lets a second server bind the same port (and steal half the calls).
        options = [("grpc.max_receive_message_length", server.config.max_request_bytes),
                   ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]  # fmt: skip
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layerzero-grpc"),
            handlers=[_GrpcHandler(self)],
            options=options,
            maximum_concurrent_rpcs=1024,
        )
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
            channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()

    def _channel(self, port: int) -> Any:
        import grpc

        with self._lock:
            channel = self._channels.get(port)
            if channel is None:
                for old in self._channels.values():  # a replaced Triton's
                    old.close()
                self._channels = {}
                channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])  # fmt: skip
                self._channels[port] = channel
            return channel

    # -------------------------------------------------------------------------------------- validation

    def validate(self, raw: bytes) -> None:
        """Check one ``ModelInferRequest`` (Cases 1-3 of the class doc); raise ``RequestError``."""
        from google.protobuf.message import DecodeError
        from tritonclient.grpc import service_pb2

        front = self.lz._front
        assert front is not None
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except (DecodeError, RecursionError, ValueError):
            raise RequestError(400, "the message is not a ModelInferRequest") from None
        model = self.lz.config.model_name
        if request.model_name != model:
            raise RequestError(404, f"no model {request.model_name[:100]!r}; this server serves {model!r}")
        if "segment" in request.parameters and request.parameters["segment"].WhichOneof("parameter_choice") != (
            "string_param"
        ):
            raise RequestError(400, 'the request parameter "segment" must be a string')
        for output in request.outputs:
            if output.name not in front.outputs:
                raise RequestError(400, f"outputs must name outputs of the model: {sorted(front.outputs)}")
        raw_contents = list(request.raw_input_contents)
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

    def call(self, method: str, raw: bytes, context: Any) -> bytes:
        """Validate (``ModelInfer``) and forward one unary call; errors end it with a status and one line."""
        import grpc

        infer = method.endswith("/ModelInfer")
        try:
            if infer:
                self.validate(raw)
            return self._forward(method, raw, context)
        except RequestError as e:
            if infer:
                self.lz.metrics.observe_error()
            code, message = _grpc_code(e.status), str(e)
        except _GrpcUpstreamError as e:
            if infer and not e.counted:
                self.lz.metrics.observe_error()
            code, message = e.code, e.message
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("gRPC front: %s failed", method)
            if infer:
                self.lz.metrics.observe_error()
            code, message = grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the server log"
        context.abort(code, _one_line(message))
        raise AssertionError("unreachable: context.abort raises")

    def _forward(self, method: str, raw: bytes, context: Any) -> bytes:
        import grpc

        lz = self.lz
        deadline = time.monotonic() + lz.config.restart_wait_s
        while True:
            if not lz._triton_ready.wait(timeout=max(0.0, deadline - time.monotonic())) or lz._stop.is_set():
                raise RequestError(503, "the inference server is restarting; retry")
            active = lz._active
            if active is None:
                time.sleep(0.005)
                continue
            remaining = context.time_remaining()  # no deadline: None, or (some gRPC versions) ~infinite
            if remaining is not None and remaining > 1e6:
                remaining = None
            try:
                return self._channel(active.grpc_port).unary_unary(method)(raw, timeout=remaining)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and not (active.alive() and lz._active is active):
                    # Triton died with this call in flight, or is being replaced: send it again.
                    if time.monotonic() > deadline or lz._stop.is_set():
                        raise RequestError(503, "the inference server is restarting; retry") from None
                    time.sleep(0.01)
                    continue
                raise _GrpcUpstreamError.of(code, str(e.details() or "")) from None


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
        return grpc.unary_unary_rpc_method_handler(lambda raw, context: self.front.call(method, raw, context))


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
        self._reader = self._sock.makefile("rb")

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
        """The status line, ``headers``, Content-Length and ``body`` (not for HEAD) in one write."""
        self.send_response(status)
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
            self.send_whole(status, headers, data, head=method == "HEAD")
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
        self.send_whole(status, [("Content-Type", content_type)], body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("control %s - " + format, self.address_string(), *args)




def _tensor(spec: IOSpec) -> Any:
    from pytriton.model_config import Tensor

    dtype = spec.numpy_dtype
    if dtype is None:
        raise InvalidInputError(f"{spec.name!r}: {spec.data_type} cannot be served through PyTriton")
    return Tensor(name=spec.name, dtype=dtype, shape=spec.dims or (1,))


def _free_ports(host: str, n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(n)]
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


@dataclasses.dataclass
class _TritonInstance:
    """One PyTriton ``Triton`` and the loopback ports it listens on."""

    triton: Any
    http_port: int
    grpc_port: int

    def alive(self) -> bool:
        # PyTriton notices a dead tritonserver only once its exit callbacks ran (~1.5 s on a loaded machine):
        # the process's own state answers at once (gone, or a zombie not reaped yet).
        pid = self.pid
        if pid is not None:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                        return False
            except FileNotFoundError:
                return False
            except OSError:
                pass  # no /proc: PyTriton's answer below
        try:
            return bool(self.triton.is_alive())
        except Exception:
            return False

    def describe(self) -> dict[str, Any]:
        """Its loopback ports and process id (``/status``)."""
        return {"http_port": self.http_port, "grpc_port": self.grpc_port, "pid": self.pid}

    @property
    def pid(self) -> int | None:
        server = getattr(self.triton, "_triton_server", None)
        cmd = getattr(server, "_tritonserver_running_cmd", None)
        return getattr(cmd, "pid", None)


def _retire(instance: _TritonInstance, wait: bool = False) -> None:
    """Stop a Triton (its process, stubs, workspace); in the background unless ``wait``: stopping takes a while
    and the supervisor must not wait on it while requests do."""
    workspace = getattr(getattr(instance.triton, "_workspace", None), "path", None)

    def stop() -> None:
        with contextlib.suppress(Exception):
            instance.triton.stop()
        if workspace is not None:
            _kill_orphan_stubs(Path(workspace))

    if wait:
        stop()
    else:
        threading.Thread(target=stop, name="layerzero-retire", daemon=True).start()


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket() as probe:
        # As Triton does: a port held only by TIME_WAIT connections is free; one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise InvalidInputError(f"{what} {port}: cannot listen on {host}:{port}: {e.strerror}") from e


def _kill_orphan_stubs(workspace: Path) -> None:
    """SIGKILL the Python-backend stubs of a Triton that died (a SIGKILLed tritonserver leaves them running,
    reparented to init, and they ignore SIGTERM): the processes whose program is this workspace's stub."""
    stub = str(workspace / "tritonserver" / "backends" / "python" / "triton_python_backend_stub").encode()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    program = f.read().split(b"\0", 1)[0]
            except OSError:
                continue
            if program == stub:
                with contextlib.suppress(OSError):
                    os.kill(int(entry), signal.SIGKILL)
                    logger.info("killed the orphaned Python-backend stub %s of a dead Triton", entry)


#: How long a PyTriton Python-backend stub (and this process) waits for the model's handshake socket.
_HANDSHAKE_TIMEOUT_S = 30.0
_HANDSHAKE_DEFAULT = b"def get_config_from_handshake_server(socket_path: pathlib.Path, timeout_s: float = 1.0)"
_handshake_patched = False


def _patch_pytriton_handshake() -> None:
    """Give PyTriton's stub handshake 30 s instead of its fixed 1 s (idempotent; a no-op on a PyTriton whose
    source differs).

    Why: Triton starts a model's instances in parallel; instance 0's stub starts the handshake server, the
    others give up after 1 s without its socket, and the model fails to load. On a loaded machine (2 shared
    cores) that happened on most starts, and a server that cannot start (or restart) is down. The stubs run
    the copy of ``pytriton/proxy/communication.py`` PyTriton puts in the model store: the copy gets the longer
    default, and so does this process's own call.
    """
    global _handshake_patched
    if _handshake_patched:
        return
    _handshake_patched = True
    try:
        import pytriton.models.model as model_module
        from pytriton.proxy import communication
    except ImportError:
        return
    patched = _HANDSHAKE_DEFAULT.replace(b"1.0)", f"{_HANDSHAKE_TIMEOUT_S})".encode())
    source = Path(communication.__file__).read_bytes()
    if _HANDSHAKE_DEFAULT not in source:
        logger.debug("PyTriton's handshake is not the one patched here; left as it is")
        return
    original_get = communication.get_config_from_handshake_server

    def get_config(socket_path: Any, timeout_s: float = _HANDSHAKE_TIMEOUT_S) -> dict:
        return original_get(socket_path, timeout_s=max(timeout_s, _HANDSHAKE_TIMEOUT_S))

    model_module.get_config_from_handshake_server = get_config
    model_class = model_module.Model
    original_files, original_generate = model_class.get_proxy_model_files, model_class.generate_model

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = original_files(self)
        for key, content in files.items():
            if key.endswith("/communication.py"):
                files[key] = content.replace(_HANDSHAKE_DEFAULT, patched)
        return files

    def generate_model(self: Any, model_repository: Path) -> None:
        original_generate(self, model_repository)
        copy = Path(model_repository) / self.model_name / str(self.model_version) / "communication.py"
        if copy.is_file():
            copy.write_bytes(copy.read_bytes().replace(_HANDSHAKE_DEFAULT, patched))

    model_class.get_proxy_model_files = get_proxy_model_files
    model_class.generate_model = generate_model


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
