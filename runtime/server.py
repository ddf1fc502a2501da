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
(``layerzero.runtime.front``: their Python does not compete for this process's GIL with PyTriton's proxy and
the infer callable): each request is validated before Triton parses it, then its bytes are forwarded over
keep-alive connections to Triton, which listens on loopback ports of its own (metrics, SageMaker, Vertex AI
off). A standby Triton is kept started: when the serving one dies the supervisor switches the fronts to it
(tens of ms; requests wait, those in flight are sent again and run once) and starts the next standby. The
supervisor restarts the front process too when it dies; its counts live in a mapping this process owns.

Control and /metrics are a small HTTP server on ``control_port`` (``layerzero.runtime.control``). Starting
and stopping Triton itself, and the fixes PyTriton needs, are ``layerzero.runtime.triton_process``; the model
facts requests are checked against, ``layerzero.runtime.model_facts``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.control import ControlServer
from layerzero.runtime.front import (
    REQUEST_ID,
    FrontProcess,
    FrontSpec,
    GrpcFront,
    InferenceFront,
    RequestError,
    may_be_empty,
    one_line,
)
from layerzero.runtime.guard import GuardedEngine
from layerzero.runtime.model_facts import empty_axes, index_ranges
from layerzero.runtime.triton_process import (
    TritonInstance,
    check_port_free,
    free_ports,
    libpython_on_library_path,
    patch_pytriton,
    retire,
    tensor_of,
)
from layerzero.runtime.triton_repo import model_io

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
        self._active: TritonInstance | None = None  # the Triton the fronts forward to
        self._standby: TritonInstance | None = None  # started, idle, takes over when the active one dies
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
        libpython_on_library_path()
        patch_pytriton()
        cfg = self.config
        if len({cfg.http_port, cfg.grpc_port, cfg.control_port}) < 3:
            raise InvalidInputError(f"the HTTP, gRPC and control ports must differ, got {cfg.http_port}, "
                                    f"{cfg.grpc_port}, {cfg.control_port}")  # fmt: skip
        for what, port in (("--port-http", cfg.http_port), ("--port-grpc", cfg.grpc_port))[: 2 if cfg.grpc else 1]:
            check_port_free(cfg.host, port, what)
        if self.guard.has_reference:
            # Load (and so check) the reference now: a broken one must fail the start, not the first request
            # that samples or the first time someone turns the kill switch on.
            try:
                self.guard.preload_reference()
            except LayerZeroError:
                raise
            except Exception as e:
                raise InvalidInputError(f"the reference model cannot be loaded: {one_line(str(e), 200)}") from None
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

    def _start_triton_retrying(self) -> TritonInstance:
        # PyTriton's handshake with its Python-backend stubs has a fixed 1 s timeout, which a loaded machine
        # misses now and then: try a few times, a little apart.
        for attempt in range(_START_ATTEMPTS):
            if self._stop.is_set() and attempt:
                break
            try:
                return self._start_triton()
            except Exception as e:
                if attempt == _START_ATTEMPTS - 1:
                    raise LayerZeroError(f"Triton Inference Server did not start: {one_line(str(e), 300)}") from None
                logger.warning("Triton did not start (%s); trying again", one_line(str(e), 200))
                time.sleep(1.0 + attempt)
        raise LayerZeroError("Triton Inference Server did not start: the server is stopping")

    def _start_triton(self) -> TritonInstance:
        """A Triton serving the model, its HTTP and gRPC on free 127.0.0.1 ports: only the fronts talk to it."""
        from pytriton.model_config import ModelConfig
        from pytriton.triton import Triton, TritonConfig

        cfg = self.config
        http_port, grpc_port = free_ports("127.0.0.1", 2)
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
                inputs=[tensor_of(s) for s in self._inputs],
                outputs=[tensor_of(s) for s in self._outputs],
                config=ModelConfig(batching=False),
                strict=False,
            )
            triton.run()
        except Exception:
            with contextlib.suppress(Exception):
                triton.stop()
            raise
        return TritonInstance(triton, http_port, grpc_port)

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
                retire(active)
            if self.config.standby:
                # The standby thread keeps one started; wait for it (it is usually up already).
                while not self._stop.is_set():
                    standby, self._standby = self._standby, None
                    if standby is not None and standby.alive():
                        self._active = standby
                        self._record_restart(died, "the standby took over")
                        break
                    if standby is not None:
                        retire(standby)
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
                logger.error("restarting Triton failed (%d): %s", failures, one_line(str(e), 300))
                if failures >= _START_ATTEMPTS:
                    self._fatal = f"Triton Inference Server could not be restarted: {one_line(str(e), 200)}"
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
            logger.error("restarting the inference front failed: %s", one_line(str(e), 300))
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
                retire(standby)
            try:
                instance = self._start_triton()
            except Exception as e:
                # Each try costs seconds of CPU: back off (to a minute) rather than compete with serving.
                logger.warning("the standby Triton did not start (%s); trying again in %.0f s",
                               one_line(str(e), 200), backoff)  # fmt: skip
                if self._stop.wait(backoff):
                    return
                backoff = min(60.0, backoff * 2)
                continue
            backoff = 2.0
            if self._stop.is_set():
                retire(instance, wait=True)
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
                retire(instance, wait=True)
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
            raise RuntimeError(f"[layerzero {status}] {one_line(message)}") from None
        self.metrics.observe(result, time.perf_counter() - started)
        return {name: result.outputs[name] for name in self._output_names}

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        # What the fronts check, again for a request that reached Triton without them (a test, a local client).
        for name, value in feeds.items():
            array = np.asarray(value)
            if array.size == 0 and not may_be_empty(array.shape, self._empty_axes.get(name, ())):
                raise RequestError(400, f"input {name!r}: shape {list(array.shape)} is empty "
                                        "(an empty sequence cannot be served)")  # fmt: skip
            rows = self._index_ranges.get(name)
            if rows is not None and array.dtype.kind in "iu" and (int(array.min()) < 0 or int(array.max()) >= rows):
                bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
                raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")


@dataclasses.dataclass
class _Run:
    """One request's run in the infer callable, by the front's request id: its answer once done."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None  # the marked message the callable raised
    nbytes: int = 0
