"""The gRPC front of Triton's KServe v2 API (``GrpcFront``): each ``ModelInfer`` is checked as the HTTP front
checks (``check``, fed by the protobuf decoder), then its bytes forwarded to Triton's loopback gRPC port."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from layerzero.errors import InvalidInputError
from layerzero.runtime.front.check import RequestFacts, check_request, decode_protobuf
from layerzero.runtime.front.spec import MARKER, REQUEST_ID, FrontSpec, RequestError, one_line
from layerzero.runtime.front.upstream import Upstream

if TYPE_CHECKING:
    from layerzero.runtime.front.http_front import InferenceFront

__all__ = ["CallWatch", "GrpcFront", "GrpcHandler", "GrpcUpstreamError", "grpc_code"]

logger = logging.getLogger(__name__)

#: How long an UNAVAILABLE answer of a Triton whose process still runs is taken for one that is dying (and the
#: call sent again) before it is answered as it is.
_UNAVAILABLE_GRACE_S = 1.0

_GRPC_SERVICE = "/inference.GRPCInferenceService/"
#: gRPC's own message limit is this far above ``max_request_bytes``: a message in between is refused (and
#: counted) by the front's code with its own one line.
_GRPC_SLACK_BYTES = 1 << 20
#: What the gRPC front forwards: inference and read-only queries. Not the repository (load / unload), shared
#: memory, trace or log settings (as over HTTP, where only inference is POSTed), nor the bidirectional stream.
_GRPC_FORWARDED = frozenset({"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                             "ModelConfig", "ModelStatistics", "ModelInfer"})  # fmt: skip

def grpc_code(status: int) -> Any:
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
       it is read, and counted when its call ends without having reached this code (``CallWatch``).
    Methods other than inference and read-only queries are UNIMPLEMENTED (not counted: not inference).
    """

    def __init__(self, spec: FrontSpec, upstream: Upstream, http: InferenceFront | None = None) -> None:
        import concurrent.futures

        import grpc

        self.spec = spec
        self.upstream = upstream
        self.facts = http.facts if http is not None else RequestFacts(spec)  # one per process, shared
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
            handlers=[GrpcHandler(self)],
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
        """Check one ``ModelInferRequest`` (Cases 1-3 of the class doc: ``check.check_request``, as over HTTP);
        raise ``RequestError``."""
        check_request(self.facts, decode_protobuf(raw, self.spec.max_request_bytes))

    # ------------------------------------------------------------------------------------------ forward

    def call(self, method: str, raw: bytes, context: Any, watch: CallWatch | None = None) -> bytes:
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
            code, message = grpc_code(e.status), str(e)
        except GrpcUpstreamError as e:
            if infer and not e.counted:
                upstream.count_error()
            code, message = e.code, e.message
        except Exception as e:  # a bug of ours: one line to the client, the traceback to our log
            logger.exception("gRPC front: %s failed", method)
            if infer:
                upstream.count_error()
            code, message = grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the server log"
        context.abort(code, one_line(message))
        raise AssertionError("unreachable: context.abort raises")

    def _forward(self, method: str, raw: bytes, context: Any, infer: bool) -> bytes:
        import grpc

        upstream = self.upstream
        metadata = ((REQUEST_ID, upstream.next_id()),) if infer else None
        deadline = time.monotonic() + self.spec.restart_wait_s
        grace: float | None = None  # until when an UNAVAILABLE from a Triton that still looks alive is sent again
        while True:
            current = upstream.wait(deadline)
            remaining = context.time_remaining()  # no deadline: None, or (some gRPC versions) ~infinite
            if remaining is not None and remaining > 1e6:
                remaining = None
            try:
                return self._callable(current[1], method)(raw, timeout=remaining, metadata=metadata)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE:
                    now = time.monotonic()
                    # A killed Triton's sockets are reset while its process is still exiting (not yet a
                    # zombie): "Stream removed", with the pid alive for a few ms more. Sent again meanwhile
                    # (the request id makes it run once), for at most _UNAVAILABLE_GRACE_S.
                    if grace is None:
                        grace = now + _UNAVAILABLE_GRACE_S
                    if not upstream.alive(current) or now < grace:
                        # Triton died with this call in flight, or is being replaced: send it again.
                        if now > deadline or upstream.stopping.is_set():
                            raise RequestError(503, "the inference server is restarting; retry") from None
                        time.sleep(0.01)
                        continue
                raise GrpcUpstreamError.of(code, str(e.details() or "")) from None


class CallWatch:
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


class GrpcUpstreamError(Exception):
    """Triton's own gRPC error, made one line (and whether the infer callable counted it already)."""

    def __init__(self, code: Any, message: str, counted: bool) -> None:
        super().__init__(message)
        self.code, self.message, self.counted = code, message, counted

    @classmethod
    def of(cls, code: Any, details: str) -> GrpcUpstreamError:
        marked = MARKER.search(details)
        if marked is not None:  # raised (and counted) by the infer callable
            return cls(grpc_code(int(marked.group(1))), marked.group(2), True)
        if "Traceback" in details or 'File "' in details:
            logger.warning("Triton answered gRPC %s: %s", code, one_line(details, 2000))
            return cls(code, "inference failed; see the server log", False)
        return cls(code, details.strip().splitlines()[0] if details.strip() else str(code), False)


class GrpcHandler:
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
        watch = CallWatch(self.front.upstream)
        return grpc.unary_unary_rpc_method_handler(lambda raw, context: self.front.call(method, raw, context, watch))
