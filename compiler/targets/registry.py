"""The target registry's data: target name -> ``"module:Class"`` of its ``Target`` subclass, and the names.

A leaf (it imports nothing): ``CompileOptions`` checks ``target`` against ``TARGETS`` from here, below the
``Target`` interface (``base.py``), whose methods take ``CompileOptions``. ``layerzero.targets.get_target``
resolves an entry on first use, so importing this imports no target and no toolkit.
"""

from __future__ import annotations

__all__ = ["TARGETS", "TARGET_CLASSES"]

#: target name -> "module:Class" of its ``Target`` subclass. A new target is one module and one line here.
TARGET_CLASSES: dict[str, str] = {
    "onnxruntime": "layerzero.targets.onnxruntime:OnnxRuntimeTarget",
    "tensorrt": "layerzero.targets.tensorrt:TensorRTTarget",
}

#: Names accepted by ``CompileOptions.target`` / ``layerzero compile --target``.
TARGETS = tuple(TARGET_CLASSES)
