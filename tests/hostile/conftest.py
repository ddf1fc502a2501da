"""Shared fixtures of the hostile suite: a tiny compiled bundle, the CLI run in-process, free ports."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_bundle import compile_tiny, free_ports


def run_cli(*args: str | Path) -> SimpleNamespace:
    """``layerzero ARGS`` in this process: exit code, stdout, stderr (argparse's exits included)."""
    from layerzero.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return SimpleNamespace(code=code, out=out.getvalue(), err=err.getvalue())


def assert_one_line_error(result: SimpleNamespace, *needles: str, code: int = 2) -> None:
    """Exit ``code``, one line on stderr that names each of ``needles``, no traceback."""
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code == code, (result.code, result.err[-2000:])
    assert len(lines) == 1, result.err[-2000:]
    assert "Traceback" not in result.err and "Traceback" not in result.out
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """``source`` (.onnx), ``bundle`` (compiled from it), ``config``; treat both as read-only."""
    return compile_tiny(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The helpers above, as a fixture (test modules cannot import a conftest by name under importlib mode)."""
    return SimpleNamespace(run_cli=run_cli, one_line=assert_one_line_error, dead_pid=dead_pid, free_ports=free_ports)
