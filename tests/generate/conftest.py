"""Fixtures of the generation tests: a module's ``llama_dir`` (a ``save_pretrained`` folder) exported with the KV
cache and compiled once per module. Each module that uses them defines its own ``tmp`` (its module temp dir) and
``llama_dir``."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerzero.cli import main


@pytest.fixture(scope="module")
def exported(llama_dir: Path, tmp: Path) -> Path:
    """``layerzero export llama_dir``: ``tmp/export/model.onnx``."""
    out = tmp / "export" / "model.onnx"
    assert main(["export", str(llama_dir), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bundle(exported: Path, tmp: Path) -> Path:
    """``layerzero compile`` of ``exported``: ``tmp/model.lz``."""
    out = tmp / "model.lz"
    assert main(["compile", str(exported), "-o", str(out)]) == 0
    return out
