"""Runtime backends. ``get_backend("onnxruntime")`` (alias ``"ort"``) returns ``OrtBackend``; backend modules
are imported on first use, so importing this package does not import onnxruntime."""

from __future__ import annotations

from layerzero.runtime.backends.base import Backend, TensorSpec, backend_names, get_backend, register_backend

__all__ = ["Backend", "TensorSpec", "backend_names", "get_backend", "register_backend"]
