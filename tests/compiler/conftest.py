"""Fixtures of the compiler tests: ``model_path``, the small example transformer (tests/compiler/shared.py)
saved in the test's temp dir."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from layerzero.models import build_transformer
from tests.compiler.shared import SMALL


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save_model(build_transformer(SMALL), path)
    return path
