"""The tiny compiled transformer the serving and hostile suites run (tests/serve/conftest.py,
tests/hostile/conftest.py), and free local ports for the servers they start."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from types import SimpleNamespace

import onnx

from layerzero.compile import compile_file
from layerzero.models import TransformerConfig, build_transformer
from layerzero.options import CompileOptions

#: Consumed flags, so that the source is an exact reference for the compiled bundle; block 1 is removed at compile
#: time.
CONFIG = TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64, flag_form="consumed", zero_blocks=(1,))


def compile_tiny(tmp: Path) -> SimpleNamespace:
    """``source`` (``tmp/source.onnx``, ``CONFIG``), ``bundle`` (``tmp/model.lz``, compiled static from it),
    ``config`` and ``dir`` (``tmp``); treat both files as read-only."""
    source = tmp / "source.onnx"
    onnx.save(build_transformer(CONFIG), str(source))
    bundle = tmp / "model.lz"
    compile_file(source, bundle, CompileOptions(dynamic=False))
    return SimpleNamespace(source=source, bundle=bundle, config=CONFIG, dir=Path(tmp))


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
