"""The HTTP front of Triton's KServe v2 API (``InferenceFront``): each inference request is read, checked
(``check``) and forwarded to Triton's loopback port over a keep-alive connection (``upstream``)."""

from __future__ import annotations

import json
import logging
import re
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import numpy as np

from layerzero.runtime._http import listen_http
from layerzero.runtime.front.body import BodyReader
from layerzero.runtime.front.check import RequestFacts, check_model, check_range, check_request, decode_json
from layerzero.runtime.front.spec import MARKER, REQUEST_ID, FrontSpec, RequestError, one_line
from layerzero.runtime.front.upstream import TritonConnection, Upstream

__all__ = ["FrontHandler", "InferenceFront"]

logger = logging.getLogger(__name__)

_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
#: validate()'s memory of JSON headers that passed: headers up to this size, this many (then forgotten).
_HEAD_CACHE_BYTES = 4096
_HEAD_CACHE_ENTRIES = 64


class InferenceFront:
    """The HTTP front of Triton's KServe v2 API: every inference request is read (capped, with a deadline) and
    validated against the model before Triton parses it, then forwarded to Triton on a loopback port.

    Cases refused (4xx, one line, counted in ``layerzero_request_errors_total``):
    1. no or bad ``Content-Length`` (411 / 400), a body over ``max_request_bytes`` (413), a compressed body (415);
    2. not JSON, nested too deep, not the KServe v2 shape (``check.decode_json``);
    3. what ``check.check_request`` refuses, as the gRPC front does: an unknown model (404), input, output or
       datatype, a shape the model does not take, data whose length differs from the shape, ids out of range.
    Triton's own errors are answered with one line: the callable's marker if there is one, else a 5xx without
    the traceback. While Triton restarts (the supervisor), requests wait for it instead of failing.
    """

    def __init__(self, spec: FrontSpec, upstream: Upstream) -> None:
        self.spec = spec
        self.upstream = upstream
        self.max_request_bytes = spec.max_request_bytes
        self.facts = RequestFacts(spec)  # what requests are checked against (the gRPC front's too)
        # JSON headers (of binary requests) that passed every check, with what remains to check of the binary
        # data: see validate().
        self._valid_heads: dict[bytes, tuple[int, list[tuple[str, Any, int, int]]]] = {}
        handler = type("Handler", (FrontHandler,), {"front": self, "timeout": spec.client_timeout_s})
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
        """Check one inference request (Cases 2-3 of the class doc: ``check.check_request``); raise
        ``RequestError``."""
        facts = self.facts
        check_model(facts, model)  # before the body is parsed at all
        if header_length is not None:
            if not header_length.isdigit() or len(header_length) > 12 or int(header_length) > len(body):
                raise RequestError(400, "Inference-Header-Content-Length must be an integer <= the body's length")
            split = int(header_length)
            head, binary = body[:split], body[split:]
            # A client sends the same JSON header with each request of a shape (tritonclient does): every check
            # but the ids' depends on the header alone, and on the binary data's length, so a header that passed
            # them once is not parsed again; the ids in the binary data are checked each time, in the same order.
            known = self._valid_heads.get(head)
            if known is not None and known[0] == len(binary):
                for name, dtype, count, at in known[1]:
                    check_range(facts, name, np.frombuffer(binary, dtype=dtype, count=count, offset=at))
                return
        else:
            head, binary = body, b""
        cache = header_length is not None and len(head) <= _HEAD_CACHE_BYTES
        offset, ranges = check_request(facts, decode_json(model, head, binary), collect=cache)
        if ranges is not None:
            if len(self._valid_heads) >= _HEAD_CACHE_ENTRIES:
                self._valid_heads.clear()  # clients cycling through many shapes: start again
            self._valid_heads[head] = (offset, ranges)

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self, handler: FrontHandler, method: str, body: bytes | None, infer: bool = False
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


class _Headers(dict):
    """A request's headers by lower-cased name (the last of repeated ones): what the front reads of them."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().get(key.lower())


class FrontHandler(BodyReader, BaseHTTPRequestHandler):
    front: InferenceFront
    protocol_version = "HTTP/1.1"
    _conn: TritonConnection | None = None

    def upstream(self, port: int) -> TritonConnection:
        """This client connection's keep-alive connection to Triton (a new one once Triton was replaced)."""
        if self._conn is not None and self._conn.port != port:
            self.drop_upstream()
        if self._conn is None:
            self._conn = TritonConnection(port)
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
        marked = MARKER.search(text)
        if marked is not None:  # raised (and counted) by the infer callable
            status, message = int(marked.group(1)), marked.group(2)
        else:
            if infer:
                self.front.upstream.count_error()
            first = text.strip().splitlines()[0] if text.strip() else ""
            if "Traceback" in text or "File \"" in text or status >= 500:
                message = "inference failed; see the server log"
                logger.warning("Triton answered %d: %s", status, one_line(text, 2000))
            else:
                message = first
        body = (json.dumps({"error": one_line(message)}) + "\n").encode()
        return status, body, [("Content-Type", "application/json")]

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("front %s - " + format, self.address_string(), *args)
