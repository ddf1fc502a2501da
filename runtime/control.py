"""The control and metrics HTTP server of ``layerzero serve`` (``ControlServer``): a small stdlib server (one
thread per connection) on ``control_port``, 127.0.0.1 only, unauthenticated (bind it to loopback, put a proxy
in front for anything else)::

    GET  /metrics                 Prometheus text (ServingMetrics, a registry of this server's own)
    GET  /status                  JSON: model, endpoints, guard state and counters
    GET  /healthz                 "ok" once Triton serves the model
    GET  /                        the web console (runtime/console.py): live counters, kill switch, threshold
    POST /kill-switch             {"on": true} | {"on": false}   (also POST /kill-switch/on, /kill-switch/off)
    POST /threshold               {"value": 0.05, "segment": "chat"}   (segment optional: the default one)

Why not a ``layerzero_control`` Triton model: control must work while inference is saturated or broken, and
Prometheus scrapes plain HTTP text; a tiny side server gives both with no client library. Triton's own
metrics endpoint is off, so there is one /metrics to scrape.
"""

from __future__ import annotations

import json
import logging
import math
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Protocol

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime._http import listen_http
from layerzero.runtime.front import BodyReader, RequestError

if TYPE_CHECKING:
    from layerzero.runtime.guard import GuardedEngine
    from layerzero.runtime.metrics import ServingMetrics


class Served(Protocol):
    """What the control server reads of the server it controls (``LayerZeroServer``; a protocol, so that this
    module does not import the server that starts it)."""

    config: Any
    guard: GuardedEngine
    metrics: ServingMetrics

    def status(self) -> dict[str, Any]: ...

    def sync_counts(self) -> None: ...


__all__ = ["CONTROL_MAX_BODY_BYTES", "ControlHandler", "ControlServer"]

logger = logging.getLogger(__name__)

#: The cap of a control request's body: its JSON documents are a few bytes.
CONTROL_MAX_BODY_BYTES = 64 * 1024


class ControlServer:
    """The control + metrics HTTP server of a ``LayerZeroServer`` (see the module doc for its endpoints)."""

    def __init__(self, server: Served, host: str, port: int) -> None:
        self.ready = False
        timeout = min(10.0, server.config.client_timeout_s)
        handler = type("Handler", (ControlHandler,), {"lz": server, "control": self, "timeout": timeout})
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


class ControlHandler(BodyReader, BaseHTTPRequestHandler):
    """Every request is answered: 200, or 400/404/405/408/411/413/409 with a one-line JSON error."""

    lz: Served
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
        if path in ("", "/console"):  # the web console (runtime/console.py)
            from layerzero.runtime.console import console_page

            page, headers = console_page()
            self.send_whole(HTTPStatus.OK, list(headers.items()), page)
        elif path == "/metrics":
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
