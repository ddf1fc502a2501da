"""Runtime backends. ``get_backend("onnxruntime")`` (alias ``"ort"``) returns ``OrtBackend``; backend modules
are imported on first use, so importing this package does not import onnxruntime."""

from __future__ import annotations

from layerzero.runtime.backends.base import Backend, TensorSpec, backend_names, get_backend, register_backend

__all__ = ["Backend", "TensorSpec", "backend_names", "get_backend", "register_backend"]

# Lazy: nothing is imported until get_backend("tensorrt") (alias "trt"); that import does not need tensorrt
# either, only TensorRTBackend.load does.
register_backend("tensorrt", "layerzero.runtime.backends.tensorrt:TensorRTBackend", aliases=("trt",))
