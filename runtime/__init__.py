"""The LayerZero runtime: engine bundles, ``Engine``, backends and the zeroing report.

    from layerzero.runtime import Engine
    result = Engine.load("model.lz").run({"x": x})

This package never imports the compiler (only ``layerzero.errors``, ``layerzero.plugins`` and
``layerzero.__version__``), and importing it does not import onnx, onnx_ir or onnxruntime: those load on
first use.
"""

from __future__ import annotations

from layerzero.runtime.backends.base import TensorSpec, get_backend
from layerzero.runtime.bundle import Bundle, read_bundle, sha256_file, write_bundle
from layerzero.runtime.engine import MASK_PREFIX, Engine, Result
from layerzero.runtime.report import Report

__all__ = [
    "MASK_PREFIX",
    "Bundle",
    "Engine",
    "Report",
    "Result",
    "TensorSpec",
    "get_backend",
    "read_bundle",
    "sha256_file",
    "write_bundle",
]
