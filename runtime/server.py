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

import dataclasses
import json
import logging
import os
import signal
import socket
import sysconfig
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.guard import GuardedEngine
from layerzero.runtime.triton_repo import IOSpec, model_io

if TYPE_CHECKING:  # prometheus_client (the serve extra) is imported when a server is made, not on import
    from layerzero.runtime.metrics import ServingMetrics

__all__ = ["ControlServer", "LayerZeroServer", "ServerConfig", "pytriton_available"]

logger = logging.getLogger(__name__)


def pytriton_available() -> bool:
    """Whether PyTriton can be imported (``pip install 'layerzero[serve]'``)."""
    try:
        import pytriton.triton  # noqa: F401
    except Exception:
        return False
    return True


@dataclasses.dataclass
class ServerConfig:
    """Where and how to serve. Triton needs fixed ports; ``control_port`` 0 picks a free one."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    control_port: int = 8002
    model_name: str = "layerzero"
    instances: int = 2
    exit_timeout_s: int = 5
    log_verbose: int = 0


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
        self._triton: Any = None
        self._control: ControlServer | None = None
        self._started = 0.0
        self._stop = threading.Event()

    # ---------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the control server, then Triton; returns once Triton serves the model."""
        if not pytriton_available():
            raise LayerZeroError("serving needs PyTriton: pip install 'layerzero[serve]'")
        from pytriton.model_config import ModelConfig
        from pytriton.triton import Triton, TritonConfig

        _libpython_on_library_path()
        cfg = self.config
        # Triton does not report a busy port to PyTriton, which then waits for it forever: check first.
        for what, port in (("--port-http", cfg.http_port), ("--port-grpc", cfg.grpc_port)):
            _check_port_free(cfg.host, port, what)
        if len({cfg.http_port, cfg.grpc_port, cfg.control_port}) < 3:
            raise InvalidInputError(f"the HTTP, gRPC and control ports must differ, got {cfg.http_port}, "
                                    f"{cfg.grpc_port}, {cfg.control_port}")  # fmt: skip
        self._started = time.monotonic()
        self._control = ControlServer(self, cfg.host, cfg.control_port)
        self._control.start()
        triton_config = TritonConfig(
            http_address=cfg.host,
            http_port=cfg.http_port,
            grpc_address=cfg.host,
            grpc_port=cfg.grpc_port,
            allow_metrics=False,
            exit_timeout_secs=cfg.exit_timeout_s,
            log_verbose=cfg.log_verbose,
        )
        try:
            if any(s["sample_rate"] > 0 for s in self.guard.stats()["segments"].values()) or self.guard.kill_switch:
                self.guard.preload_reference()
            self._triton = Triton(config=triton_config)
            self._triton.bind(
                model_name=cfg.model_name,
                infer_func=[self._infer] * max(1, cfg.instances),
                inputs=[_tensor(s) for s in self._inputs],
                outputs=[_tensor(s) for s in self._outputs],
                config=ModelConfig(batching=False),
                strict=False,
            )
            self._triton.run()
        except Exception:
            self.stop()
            raise
        self._control.ready = True
        logger.info("serving %s: %s", cfg.model_name, self.endpoints())

    def stop(self) -> None:
        """Stop Triton and the control server (idempotent)."""
        self._stop.set()
        if self._control is not None:
            self._control.ready = False
        triton, self._triton = self._triton, None
        if triton is not None:
            triton.stop()
        control, self._control = self._control, None
        if control is not None:
            control.stop()

    def wait(self) -> None:
        """Block until SIGINT/SIGTERM (main thread) or ``stop()``, or until Triton dies (then raise)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(0.5):
            if self._triton is not None and not self._triton.is_alive():
                raise LayerZeroError("Triton Inference Server exited unexpectedly; see its log above")

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
        }

    # -------------------------------------------------------------------------------------------- infer

    def _infer(self, requests: list) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            started = time.perf_counter()
            try:
                params = getattr(request, "parameters", None) or {}
                segment = params.get("segment")
                result = self.guard.run(request.data, segment=None if segment is None else str(segment))
            except Exception:
                self.metrics.observe_error()
                raise
            self.metrics.observe(result, time.perf_counter() - started)
            responses.append({name: result.outputs[name] for name in self._output_names})
        return responses


class ControlServer:
    """The control + metrics HTTP server of a ``LayerZeroServer`` (see the module doc for its endpoints)."""

    def __init__(self, server: LayerZeroServer, host: str, port: int) -> None:
        self.ready = False
        handler = type("Handler", (_ControlHandler,), {"lz": server, "control": self})
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


class _ControlHandler(BaseHTTPRequestHandler):
    lz: LayerZeroServer
    control: ControlServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
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
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path!r}; see GET /status"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            body = self._body()
            guard = self.lz.guard
            if path in ("/kill-switch", "/kill-switch/on", "/kill-switch/off"):
                on = path.endswith("/on") if path != "/kill-switch" else body.get("on")
                if not isinstance(on, bool):
                    raise InvalidInputError('POST /kill-switch needs a JSON body {"on": true|false}')
                if on:
                    guard.preload_reference()  # load before flipping, so the flip costs requests nothing
                guard.set_kill_switch(on)
                self._json(HTTPStatus.OK, {"kill_switch": guard.kill_switch})
            elif path == "/threshold":
                value, segment = body.get("value"), body.get("segment")
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise InvalidInputError('POST /threshold needs a JSON body {"value": 0.05, "segment": optional}')
                guard.set_threshold(float(value), segment)
                self._json(HTTPStatus.OK, {"segment": segment, "threshold": guard.threshold(segment),
                                           "effective": guard.has_threshold_input})  # fmt: skip
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path!r}"})
        except InvalidInputError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except LayerZeroError as e:
            self._json(HTTPStatus.CONFLICT, {"error": str(e)})

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return {}
        try:
            doc = json.loads(self.rfile.read(length))
        except ValueError as e:
            raise InvalidInputError(f"the request body is not JSON: {e}") from e
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


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket() as probe:
        # As Triton does: a port held only by TIME_WAIT connections is free; one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise InvalidInputError(f"{what} {port}: cannot listen on {host}:{port}: {e.strerror}") from e


def _libpython_on_library_path() -> None:
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir not in current.split(os.pathsep):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, current) if p)
