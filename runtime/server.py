"""Serve a guarded engine with Triton Inference Server (PyTriton), plus a control and metrics endpoint.

    server = LayerZeroServer(GuardedEngine(Engine.load("model.lz"), "model.onnx", GuardConfig()))
    with server:                      # starts Triton and the control server, stops both on exit
        server.wait()                 # until SIGINT/SIGTERM (what `layerzero serve` does)

Inference is Triton's own KServe v2 API over HTTP and gRPC (on 127.0.0.1), one model named ``layerzero`` (or
``ServerConfig.model_name``) with the engine's inputs and user outputs (skip masks stripped), dynamic dims -1,
``max_batch_size: 0``, served by ``instances`` Python-backend instances (PyTriton runs the infer function in
this process, one thread per instance; the guard is thread-safe). A request picks its guard segment with the
KServe request parameter ``segment`` (``client.infer(..., parameters={"segment": "chat"})``).

The public HTTP and gRPC ports are the fronts (``InferenceFront``, ``GrpcFront``), in a process of their own
(``layerzero.runtime._front``: their Python does not compete for this process's GIL with PyTriton's proxy and
the infer callable): each request is validated before Triton parses it, then its bytes are forwarded over
keep-alive connections to Triton, which listens on loopback ports of its own (metrics, SageMaker, Vertex AI
off). A standby Triton is kept started: when the serving one dies the supervisor switches the fronts to it
(tens of ms; requests wait, those in flight are sent again and run once) and starts the next standby. The
supervisor restarts the front process too when it dies; its counts live in a mapping this process owns.

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

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sysconfig
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime._front import (
    REQUEST_ID,
    FrontProcess,
    FrontSpec,
    GrpcFront,
    InferenceFront,
    RequestError,
    _BodyReader,
    _one_line,
)
from layerzero.runtime._http import listen_http
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
    "empty_axes",
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
#: Answers kept by request id, so that a request sent again (Triton died with it in flight) runs once: at most
#: this many, and this many bytes of outputs. Only answers in transit when Triton dies are ever asked again.
_ANSWERS_KEPT = 256
_ANSWERS_KEPT_BYTES = 64 * 1024 * 1024


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
        self._empty_axes = empty_axes(guard.engine.model_path)
        self._active: _TritonInstance | None = None  # the Triton the fronts forward to
        self._standby: _TritonInstance | None = None  # started, idle, takes over when the active one dies
        self._standby_thread: threading.Thread | None = None
        self._control: ControlServer | None = None
        self._front: FrontProcess | None = None  # the HTTP (and gRPC) front's process
        self._front_errors_seen = 0  # of its error count, what metrics has been given
        self._counts_lock = threading.Lock()
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()  # by request id
        self._runs_bytes = 0
        self._runs_lock = threading.Lock()
        self.front_restarts = 0  # times the supervisor restarted the front process
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
            self._front = FrontProcess(self._front_spec())
            self._front.start()
            self._active = self._start_triton_retrying()
            self._front.set_triton(self._active.http_port, self._active.grpc_port, self._active.pid)
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

    def _front_spec(self) -> FrontSpec:
        cfg = self.config
        return FrontSpec(
            model_name=cfg.model_name, inputs=list(self._inputs), outputs=list(self._output_names),
            index_ranges=dict(self._index_ranges), host=cfg.host, http_port=cfg.http_port,
            grpc_port=cfg.grpc_port if cfg.grpc else None, max_request_bytes=cfg.max_request_bytes,
            client_timeout_s=cfg.client_timeout_s, restart_wait_s=cfg.restart_wait_s, instances=cfg.instances,
            empty_axes=dict(self._empty_axes),
        )  # fmt: skip

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
            # The front's request id reaches the infer callable as a request parameter (see _infer).
            http_header_forward_pattern=REQUEST_ID,
            grpc_header_forward_pattern=REQUEST_ID,
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
            self.sync_counts()
            self._keep_front()
            active = self._active
            if active is not None and active.alive():
                continue
            died = time.monotonic()
            self._triton_ready.clear()
            if self._front is not None:
                self._front.restarting()
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

    def _keep_front(self) -> None:
        """Restart the front process when it died (its ports are free again once it is gone)."""
        front = self._front
        if front is None or front.alive() or self._stop.is_set():
            return
        logger.error("the inference front (pid %s) exited unexpectedly; restarting it", front.pid)
        front.stop()
        try:
            front.start()  # tells it where Triton is
        except LayerZeroError as e:
            logger.error("restarting the inference front failed: %s", _one_line(str(e), 300))
            return  # tried again on the next round
        self.front_restarts += 1
        logger.warning("inference front restarted (pid %s; %d restart(s) so far)", front.pid, self.front_restarts)

    def sync_counts(self) -> None:
        """Give metrics the errors the front counted since the last call (each once)."""
        front = self._front
        if front is None:
            return
        with self._counts_lock:
            errors = front.errors
            for _ in range(errors - self._front_errors_seen):
                self.metrics.observe_error()
            self._front_errors_seen = max(self._front_errors_seen, errors)

    def _record_restart(self, died: float, how: str) -> None:
        active = self._active
        if self._front is not None and active is not None:
            self._front.set_triton(active.http_port, active.grpc_port, active.pid)
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
        front = self._front
        if front is not None:
            front.stop()
            self.sync_counts()  # what it counted until it stopped
            front.close()
        self._front = None
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
            "front": {"pid": self._front.pid if self._front is not None else None, "restarts": self.front_restarts},
        }

    @property
    def front_pid(self) -> int | None:
        """The front process's id (for the supervisor's tests)."""
        return self._front.pid if self._front is not None else None

    # -------------------------------------------------------------------------------------------- infer

    def _infer(self, requests: list) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            params = getattr(request, "parameters", None) or {}
            run, first = self._claim(params.get(REQUEST_ID))
            if not first and run.done.wait(self.config.restart_wait_s):
                # The front sent this request again (Triton died with it in flight): the first run's answer, which
                # was lost with that Triton, run and counted once.
                if run.error is not None:
                    raise RuntimeError(run.error)
                assert run.outputs is not None
                responses.append(run.outputs)
                continue
            try:
                outputs = self._infer_one(request, params)
            except RuntimeError as e:
                self._finish(run, None, str(e))
                raise
            self._finish(run, outputs, None)
            responses.append(outputs)
        return responses

    def _claim(self, request_id: Any) -> tuple[_Run, bool]:
        """The run of ``request_id`` and whether this call is the first (``False``: a resent request)."""
        if not isinstance(request_id, str):
            return _Run(), True  # not through the front (a test calling Triton directly)
        with self._runs_lock:
            run = self._runs.get(request_id)
            if run is not None:
                return run, False
            run = self._runs[request_id] = _Run()
            return run, True

    def _finish(self, run: _Run, outputs: dict[str, np.ndarray] | None, error: str | None) -> None:
        run.outputs, run.error = outputs, error
        run.nbytes = sum(int(a.nbytes) for a in outputs.values()) if outputs is not None else 0
        run.done.set()
        with self._runs_lock:
            self._runs_bytes += run.nbytes
            # Forget the oldest answers (finished ones only: one being computed is waited for by its resend).
            while len(self._runs) > _ANSWERS_KEPT or self._runs_bytes > _ANSWERS_KEPT_BYTES:
                key, oldest = next(iter(self._runs.items()))
                if not oldest.done.is_set():
                    break
                del self._runs[key]
                self._runs_bytes -= oldest.nbytes

    def _infer_one(self, request: Any, params: dict[str, Any]) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        try:
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
        return {name: result.outputs[name] for name in self._output_names}

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        # What the front checks for HTTP, again for gRPC (which reaches Triton directly).
        for name, value in feeds.items():
            array = np.asarray(value)
            if array.size == 0 and not may_be_empty(array.shape, self._empty_axes.get(name, ())):
                raise RequestError(400, f"input {name!r}: shape {list(array.shape)} is empty "
                                        "(an empty sequence cannot be served)")  # fmt: skip
            rows = self._index_ranges.get(name)
            if rows is not None and array.dtype.kind in "iu" and (int(array.min()) < 0 or int(array.max()) >= rows):
                bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
                raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")


#: Ops that pass a tensor on with its dims (an empty past stays an empty past) on the way to its Concat.
_PASS_DIMS = frozenset({"Cast", "Identity"})


def empty_axes(model_path: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Inputs that may come with a dim of 0 and on which axes: name -> axes. Weights are not loaded (dims only).

    An axis qualifies when it is symbolic in the model and the input only reaches a ``Concat`` along that axis
    (through ``Cast`` / ``Identity``), its shape aside (``Shape``, ``Size``): a KV cache's past, empty on a
    client's first step (``[1, heads, 0, head_dim]``), to which the step's keys are appended. Anything else (an
    empty ``input_ids``) is still refused: nothing says the model can take it.
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    uses: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            uses.setdefault(name, []).append(node)
    initializers = {t.name for t in graph.initializer}
    axes: dict[str, list[int]] = {}
    for value in graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        rank = len(dims)
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") or not _reaches_concat_only(value.name, axis, rank, uses):
                continue
            axes.setdefault(value.name, []).append(axis)
    return axes


def _reaches_concat_only(name: str, axis: int, rank: int, uses: dict[str, list[Any]], depth: int = 0) -> bool:
    """Whether ``name`` reaches at least one ``Concat`` along ``axis`` and nothing else but its shape."""
    concats = 0
    for node in uses.get(name, []):
        if node.op_type in ("Shape", "Size"):
            continue
        if node.op_type in _PASS_DIMS and depth < 4:
            if not _reaches_concat_only(node.output[0], axis, rank, uses, depth + 1):
                return False
            concats += 1
            continue
        along = next((a.i for a in node.attribute if a.name == "axis"), None)
        if node.op_type != "Concat" or along is None or along % rank != axis:
            return False
        concats += 1
    return concats > 0


def may_be_empty(shape: Any, axes: Any) -> bool:
    """Whether a tensor of ``shape`` with no elements is one the model takes: each 0 on one of ``axes``
    (``empty_axes``)."""
    return any(d == 0 for d in shape) and all(d != 0 or i in axes for i, d in enumerate(shape))


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



@dataclasses.dataclass
class _Run:
    """One request's run in the infer callable, by the front's request id: its answer once done."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None  # the marked message the callable raised
    nbytes: int = 0


class ControlServer:
    """The control + metrics HTTP server of a ``LayerZeroServer`` (see the module doc for its endpoints)."""

    def __init__(self, server: LayerZeroServer, host: str, port: int) -> None:
        self.ready = False
        timeout = min(10.0, server.config.client_timeout_s)
        handler = type("Handler", (_ControlHandler,), {"lz": server, "control": self, "timeout": timeout})
        self._httpd, self._thread = listen_http(host, port, handler, "layerzero-control", "control and /metrics")

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
        self.lz.sync_counts()  # the front's counts up to now, in /metrics and /status alike
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
    source differs), and let its tensor store carry tensors with no elements (``_EMPTY_COPY``).

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
    _patch_empty_tensors()
    _patch_triton_log()
    replacements: dict[str, tuple[bytes, bytes]] = {"data.py": (_EMPTY_COPY, _EMPTY_COPY_FIXED)}
    source = Path(communication.__file__).read_bytes()
    if _HANDSHAKE_DEFAULT in source:
        patched = _HANDSHAKE_DEFAULT.replace(b"1.0)", f"{_HANDSHAKE_TIMEOUT_S})".encode())
        replacements["communication.py"] = (_HANDSHAKE_DEFAULT, patched)
        original_get = communication.get_config_from_handshake_server

        def get_config(socket_path: Any, timeout_s: float = _HANDSHAKE_TIMEOUT_S) -> dict:
            return original_get(socket_path, timeout_s=max(timeout_s, _HANDSHAKE_TIMEOUT_S))

        model_module.get_config_from_handshake_server = get_config
    else:
        logger.debug("PyTriton's handshake is not the one patched here; left as it is")
    model_class = model_module.Model
    original_files, original_generate = model_class.get_proxy_model_files, model_class.generate_model

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = original_files(self)
        for key, content in files.items():
            for name, (old, new) in replacements.items():
                if key.endswith("/" + name):
                    files[key] = content.replace(old, new)
        return files

    def generate_model(self: Any, model_repository: Path) -> None:
        original_generate(self, model_repository)
        for name, (old, new) in replacements.items():
            copy = Path(model_repository) / self.model_name / str(self.model_version) / name
            if copy.is_file():
                copy.write_bytes(copy.read_bytes().replace(old, new))

    model_class.get_proxy_model_files = get_proxy_model_files
    model_class.generate_model = generate_model


#: PyTriton's tensor store copies each frame with ``memoryview.cast("B")``, which refuses a view with a zero in
#: its shape: a tensor with no elements (a KV cache's empty past on a client's first step) failed in the
#: Python-backend stub with "cannot cast view with zeros in shape or strides". An empty frame is copied as b"".
_EMPTY_COPY = b'= frame.cast("B")\n'
_EMPTY_COPY_FIXED = b'= frame.cast("B") if frame.nbytes else b""\n'


def _patch_empty_tensors() -> None:
    """The same fix in this process (the infer callable's answers go through the same store)."""
    from pytriton.proxy import data

    store = data.TensorStore
    original = store._copy_frames
    if getattr(original, "layerzero_patched", False):
        return

    def copy_frames(self: Any, frames: list, shm: Any, offset: int) -> int:
        frames = [b"" if isinstance(f, memoryview) and not f.nbytes else f for f in frames]
        return original(self, frames, shm, offset)

    copy_frames.layerzero_patched = True  # type: ignore[attr-defined]
    store._copy_frames = copy_frames


#: Lines tritonserver writes on every start on a machine without a CUDA driver (a CPU machine): errors and
#: warnings by their look, harmless there (there is no GPU to pin memory for or to pool), and one more it
#: writes whatever the machine for a model whose config PyTriton gives as content rather than a file.
_HARMLESS_TRITON_LINES = (
    "CudaDriverHelper has not been initialized",
    "Unable to allocate pinned system memory, pinned memory pool will not be available: CUDA driver version is "
    "insufficient",
    "CUDA memory pool disabled",
    "Failed to set config modification time: model_config_content_name_ is empty",
)
_CPU_NOTE = ("Triton: no CUDA driver on this machine: serving on the CPU (its CUDA memory pools are off; "
             "tritonserver's CudaDriverHelper / pinned memory lines about that are harmless, not shown)")


def triton_log_line_shown(line: str) -> bool:
    """Whether a tritonserver log line is shown: not one of ``_HARMLESS_TRITON_LINES``, which read as errors."""
    return not any(harmless in line for harmless in _HARMLESS_TRITON_LINES)


def _patch_triton_log() -> None:
    """tritonserver's output, which PyTriton prints line by line, without ``_HARMLESS_TRITON_LINES``; on a CPU
    machine one line (ours, INFO) says what they were."""
    from pytriton.server import triton_server

    server_class = triton_server.TritonServer
    original = server_class._record_logs
    if getattr(original, "layerzero_patched", False):
        return
    noted = threading.Event()

    def record_logs(self: Any, chunk: bytes | str) -> None:
        # PyTriton reads the output unbuffered: a chunk holds parts of lines; whole lines are judged.
        text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        text = self.__dict__.pop("_layerzero_partial", "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._layerzero_partial = rest
        shown = []
        for line in lines:
            if triton_log_line_shown(line):
                shown.append(line + "\n")
            elif "CudaDriverHelper" in line and not noted.is_set():
                noted.set()
                logger.info(_CPU_NOTE)
        if shown:
            original(self, "".join(shown))

    record_logs.layerzero_patched = True  # type: ignore[attr-defined]
    server_class._record_logs = record_logs


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
