"""Compile targets: one module per target behind ``layerzero.targets.base.Target``, and their registry.

- ``onnxruntime`` (default, ``onnxruntime.py``): the compiled graph for ONNX Runtime.
- ``tensorrt`` (``tensorrt.py``): plugin nodes for TensorRT's ONNX parser and an engine plan.

A new target is one module here plus one line in ``TARGET_CLASSES`` (``registry.py``, a leaf, so that
``CompileOptions`` checks a name without importing the ``Target`` interface). Entries are ``"module:Class"``
references imported on first use, so importing this package (``layerzero compile --help``) imports no toolkit;
``tests/compiler/test_targets.py`` resolves every entry, so a typo fails the tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.targets.registry import TARGET_CLASSES, TARGETS

if TYPE_CHECKING:
    from layerzero.targets.base import Target

__all__ = ["PRECISIONS", "TARGETS", "TARGET_CLASSES", "get_target"]

#: ``--target tensorrt --precision``: here, not in ``tensorrt.py``, so that building the CLI imports no toolkit.
PRECISIONS = ("fp32", "fp16", "bf16")

_INSTANCES: dict[str, Target] = {}


def get_target(name: str) -> Target:
    """The target registered as ``name``.

    Raises:
        InvalidInputError: unknown name; the message lists the known ones.
    """
    target = _INSTANCES.get(name)
    if target is not None:
        return target
    if name not in TARGET_CLASSES:
        raise InvalidInputError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    module_name, _, class_name = TARGET_CLASSES[name].partition(":")
    target = getattr(importlib.import_module(module_name), class_name)()
    if target.name != name:
        raise LayerZeroError(
            f"{TARGET_CLASSES[name]} is registered as {name!r} but names itself {target.name!r}"
        )
    _INSTANCES[name] = target
    return target
