"""The front's side of Triton: where it listens and whether it is being replaced (``Upstream``, with the counts
the parent reads), and the keep-alive HTTP/1.1 connection the HTTP front forwards over (``TritonConnection``)."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import socket
import threading
import time

from layerzero.runtime.front.spec import RequestError

__all__ = ["COUNTERS_BYTES", "ERRORS_OFFSET", "REQUESTS_OFFSET", "TritonConnection", "Upstream", "pid_alive"]

#: Bytes of the shared counters mapping, written by the front only: inference requests refused or failed in
#: the front at ``ERRORS_OFFSET``, inference requests seen at ``REQUESTS_OFFSET`` (8-byte integers).
COUNTERS_BYTES = 64
ERRORS_OFFSET, REQUESTS_OFFSET = 0, 8


class Upstream:
    """The front's view of Triton (where it listens, whether it is being replaced) and its shared counters."""

    def __init__(self, counters: mmap.mmap | None = None) -> None:
        self.ready = threading.Event()  # set while a Triton serves; cleared while the supervisor replaces it
        self.stopping = threading.Event()
        self.current: tuple[int, int, int | None] | None = None  # (http port, grpc port, pid), one assignment
        self._counters = counters if counters is not None else mmap.mmap(-1, COUNTERS_BYTES)
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
        return self.current == current and pid_alive(current[2])

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
        self._add(ERRORS_OFFSET)

    def count_request(self) -> None:
        self._add(REQUESTS_OFFSET)

    def _add(self, offset: int) -> None:
        # NOTE: one writer (this process, under the lock); the parent only reads. An aligned 8-byte store.
        with self._lock:
            self._slots[offset // 8] += 1


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return True  # unknown: assume so (a dead one shows as refused connections, sent again)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        return True


class TritonConnection:
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
