"""The front process: its parent's handle (``FrontProcess``) and its own ``main`` (``python -m
layerzero.runtime.front``). The protocol is the package doc's: a ``FrontSpec`` as one JSON line on stdin, one
line back (ready, or the error), then one JSON command a line until ``{"stop": true}`` or the end of stdin."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.front.grpc_front import GrpcFront
from layerzero.runtime.front.http_front import InferenceFront
from layerzero.runtime.front.spec import FrontSpec, one_line
from layerzero.runtime.front.upstream import COUNTERS_BYTES, ERRORS_OFFSET, REQUESTS_OFFSET, Upstream

__all__ = ["FrontProcess", "main", "read_line"]

logger = logging.getLogger(__name__)

#: How long the parent waits for a front to listen (imports on a loaded machine take seconds).
_START_TIMEOUT_S = 120.0


class FrontProcess:
    """A front process (``python -m layerzero.runtime.front``), started and followed by the parent."""

    def __init__(self, spec: FrontSpec) -> None:
        self.spec = spec
        # The mapping's file lives as long as this object (closed in close()), not a with-block.
        self._counters_file = tempfile.TemporaryFile()  # noqa: SIM115
        self._counters_file.truncate(COUNTERS_BYTES)
        self._counters = mmap.mmap(self._counters_file.fileno(), COUNTERS_BYTES)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._triton: tuple[int, int, int | None] | None = None
        self.starts = 0  # how many front processes were started (restarts = starts - 1)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def errors(self) -> int:
        """Inference requests the front refused or saw fail without the infer callable counting them."""
        return int(struct.unpack_from("q", self._counters, ERRORS_OFFSET)[0])

    @property
    def requests(self) -> int:
        """Inference requests the front received (valid or not)."""
        return int(struct.unpack_from("q", self._counters, REQUESTS_OFFSET)[0])

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.poll() is None

    def start(self) -> None:
        """Start the process; return once its ports listen. Raises ``InvalidInputError`` (a port it cannot
        listen on) or ``LayerZeroError`` (it did not start), one line."""
        fd = self._counters_file.fileno()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen(
            [sys.executable, "-m", "layerzero.runtime.front", str(fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), env=env, close_fds=True,
        )  # fmt: skip
        self._process = process
        self.starts += 1
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write((self.spec.to_json() + "\n").encode())
            process.stdin.flush()
        except OSError:
            pass  # it died at once: its answer (none) says so below
        answer = read_line(process.stdout, _START_TIMEOUT_S)
        doc: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            doc = json.loads(answer) if answer else {}
        if doc.get("ready") is True:
            if self._triton is not None:
                self._send({"triton": list(self._triton)})
            return
        self.kill()
        if doc.get("invalid"):
            raise InvalidInputError(str(doc["invalid"]))
        raise LayerZeroError(f"the inference front did not start: {doc.get('error') or 'it exited'}")

    def set_triton(self, http_port: int, grpc_port: int, pid: int | None) -> None:
        self._triton = (http_port, grpc_port, pid)
        self._send({"triton": list(self._triton)})

    def restarting(self) -> None:
        self._triton = None
        self._send({"restarting": True})

    def _send(self, doc: dict[str, Any]) -> None:
        process = self._process
        if process is None or process.stdin is None:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):  # a dead front is restarted by the supervisor
            process.stdin.write((json.dumps(doc) + "\n").encode())
            process.stdin.flush()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the process (gracefully, then SIGKILL) and wait for it: nothing is left running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with self._lock, contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.write(b'{"stop": true}\n')
                process.stdin.flush()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    def kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self.stop()

    def close(self) -> None:
        """Stop it and release the counters (read ``errors`` before)."""
        self.stop()
        with contextlib.suppress(Exception):
            self._counters.close()
            self._counters_file.close()


def read_line(stream: IO[bytes], timeout: float) -> bytes:
    """One line from a child's stdout, or b"" when it closes or ``timeout`` passes."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline(65536)), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else b""


# ----------------------------------------------------------------------------------- the front's side


def main(argv: list[str] | None = None) -> int:
    """The front process: see the module doc."""
    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C in a terminal reaches the whole process group: the parent shuts down and stops this process in
    # order (stdin's {"stop"} or its end); no KeyboardInterrupt traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="layerzero front: %(levelname)s %(message)s")
    out = sys.stdout.buffer

    def answer(doc: dict[str, Any]) -> None:
        out.write((json.dumps(doc) + "\n").encode())
        out.flush()

    fd = int(argv[0])
    counters = mmap.mmap(fd, COUNTERS_BYTES)
    spec = FrontSpec.from_json(sys.stdin.buffer.readline().decode())
    upstream = Upstream(counters)
    fronts: list[Any] = []
    try:
        http = InferenceFront(spec, upstream)
        fronts.append(http)
        if spec.grpc_port is not None:
            fronts.append(GrpcFront(spec, upstream, http))
        for front in fronts:
            front.start()
    except InvalidInputError as e:
        answer({"invalid": str(e)})
        return 2
    except Exception as e:
        answer({"error": one_line(f"{type(e).__name__}: {e}", 300)})
        return 1
    answer({"ready": True})
    for line in sys.stdin.buffer:  # until {"stop"} or the parent is gone (end of stdin)
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if "triton" in doc:
            upstream.set_triton(*doc["triton"])
        elif doc.get("restarting"):
            upstream.restarting()
        elif doc.get("stop"):
            break
    upstream.stopping.set()
    upstream.ready.set()  # waiting requests answer 503 at once
    for front in reversed(fronts):
        with contextlib.suppress(Exception):
            front.stop()
    return 0
