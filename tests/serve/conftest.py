"""Shared fixtures of the serving tests: free ports, the tiny served model, and the ``serve`` marker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest

from layerzero.compile import compile_file
from layerzero.models import TransformerConfig, build_transformer
from layerzero.options import CompileOptions

#: Consumed flags, so that the source is an exact reference for the compiled bundle.
CONFIG = TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64, flag_form="consumed", zero_blocks=(1,))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serve: starts a real Triton server on 127.0.0.1 (needs PyTriton)")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


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
    tmp = tmp_path_factory.mktemp("served")
    source = tmp / "source.onnx"
    onnx.save(build_transformer(CONFIG), str(source))
    bundle = tmp / "model.lz"
    compile_file(source, bundle, CompileOptions(dynamic=False))
    return SimpleNamespace(source=source, bundle=bundle, config=CONFIG, dir=Path(tmp))


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


@pytest.fixture(scope="session")
def net() -> SimpleNamespace:
    """``net.free_ports(n)``, ``net.http(method, url, body)``, ``net.stop(process)`` (fixtures, since test
    modules cannot import a conftest by name under --import-mode=importlib)."""
    return SimpleNamespace(free_ports=free_ports, http=http, stop=stop)
