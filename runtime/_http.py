"""One way to start the project's threaded HTTP servers (inference front, control server, generate endpoint)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from layerzero.errors import InvalidInputError

__all__ = ["listen_http"]


def listen_http(
    host: str, port: int, handler: type[BaseHTTPRequestHandler], name: str, what: str
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A ``ThreadingHTTPServer`` bound to ``host:port`` (daemon request threads) and its not yet started serving
    thread; a port that cannot be bound raises ``InvalidInputError`` naming ``what`` it was for."""
    try:
        httpd = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise InvalidInputError(f"{what}: cannot listen on {host}:{port}: {e.strerror}") from e
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name=name, daemon=True)
    return httpd, thread
