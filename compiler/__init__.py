"""LayerZero: an ONNX compiler that removes computation which is zero, and its runtime.

Importing ``layerzero`` is cheap: the compile pipeline loads on first use, so that
``layerzero.runtime`` (which must never import the compiler) stays light.
"""

from __future__ import annotations

__all__ = ["CompileOptions", "CompileResult", "__version__", "compile_model"]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("compile_model", "CompileResult"):
        from layerzero import compile as _compile

        return getattr(_compile, name)
    if name == "CompileOptions":
        from layerzero.options import CompileOptions

        return CompileOptions
    raise AttributeError(f"module 'layerzero' has no attribute {name!r}")
