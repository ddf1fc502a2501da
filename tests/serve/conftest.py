"""Shared fixtures of the serving tests: free ports, the tiny served model, and the ``serve`` marker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_bundle import compile_tiny, free_ports


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serve: starts a real Triton server on 127.0.0.1 (needs PyTriton)")


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return compile_tiny(tmp_path_factory.mktemp("served"))


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    """Stop a server started with ``start_new_session=True``: ``sig`` to it alone (so it shuts its children
    down in order; a signal to the whole group leaves Triton's Python stubs, which ignore SIGTERM, running),
    then SIGKILL to whatever of its session is left."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


#: How long ``serve`` waits for ``layerzero serve`` to answer ``/healthz``.
START_TIMEOUT_S = 90


@contextlib.contextmanager
def serve(bundle: Path, log: Path, *args: str) -> Iterator[SimpleNamespace]:
    """``layerzero serve bundle *args`` on free ports (``--port-http``, ``--port-grpc``, ``--port-metrics``), its
    output in ``log``, once its control port answers ``/healthz``: ``http`` and ``grpc`` (host:port), ``control``
    (its URL), ``process``; stopped (``stop``) on the way out. A server that exits or is not ready within
    ``START_TIMEOUT_S`` fails the test with the end of its log."""
    http_port, grpc_port, control_port = free_ports(3)
    command = [
        sys.executable, "-m", "layerzero", "serve", str(bundle), *args,
        "--port-http", str(http_port), "--port-grpc", str(grpc_port), "--port-metrics", str(control_port),
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    control = f"http://127.0.0.1:{control_port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"`layerzero serve` exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(OSError):
                if http("GET", f"{control}/healthz", timeout=1)[0] == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"`layerzero serve` not ready after {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield SimpleNamespace(
            http=f"127.0.0.1:{http_port}", grpc=f"127.0.0.1:{grpc_port}", control=control, process=process
        )
    finally:
        stop(process)


@pytest.fixture(scope="session")
def net() -> SimpleNamespace:
    """``net.free_ports(n)``, ``net.http(method, url, body)``, ``net.stop(process)``, ``net.serve(bundle, log,
    *args)`` (fixtures, since test modules cannot import a conftest by name under --import-mode=importlib)."""
    return SimpleNamespace(free_ports=free_ports, http=http, stop=stop, serve=serve)
