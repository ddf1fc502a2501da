"""Compile targets beyond the default ONNX Runtime bundle. ``tensorrt``: a TensorRT engine plan (``tensorrt.py``).

Each target module imports its toolkit (``tensorrt``) only when it builds, so importing this package is free.
"""

from __future__ import annotations

__all__ = ["TARGETS"]

#: Names accepted by ``CompileOptions.target`` / ``layerzero compile --target``.
TARGETS = ("onnxruntime", "tensorrt")
