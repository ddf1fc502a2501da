"""The backend protocol every runtime backend implements, its tensor spec, and the backend registry.

A backend is deliberately small (Polygraphy's runner is the model): load a model file, describe its inputs
and outputs, run it on a dict of numpy arrays. Feed validation, mask stripping and reporting live in
``Engine``, once, for every backend. Backends raise ``layerzero.errors`` types: ``InvalidInputError`` for bad
options or feeds the backend rejects, ``UnsupportedModelError`` for a model it cannot load, ``LayerZeroError``
for other failures.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from layerzero.errors import InvalidInputError

__all__ = ["Backend", "TensorSpec", "backend_names", "get_backend", "register_backend", "reject_unknown_options"]

logger = logging.getLogger(__name__)

Dim = int | str | None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of a model input.

    ``shape`` holds an int for a static dim, a str for a named dynamic dim (``"batch"``), None for an unnamed
    dynamic dim; ``shape`` itself is None when the model does not declare the rank.
    """

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...] | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def describe(self) -> str:
        """``float32[batch, 4]`` (or ``float32[?]`` for unknown rank)."""
        if self.shape is None:
            return f"{self.dtype}[?]"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


@runtime_checkable
class Backend(Protocol):
    """What ``Engine`` needs from a backend. Instances are created with no arguments, then ``load``-ed.

    Optional class attributes: ``targets``, the compile targets whose bundles it runs (``Engine.load`` checks the
    manifest's ``target``); ``loads_onnx``, whether ``load`` takes any ONNX file (the profiler runs a bundle's
    force-off variant on the bundle's backend only then).
    """

    name: str

    def load(self, model_path: Path, **options: Any) -> None:
        """Load the model file; unknown options raise ``InvalidInputError`` naming them."""
        ...

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run on validated feeds; return every graph output, in ``output_names`` order."""
        ...

    @property
    def input_specs(self) -> list[TensorSpec]: ...

    @property
    def output_names(self) -> list[str]:
        """Every graph output, mask outputs included (``Engine`` strips those)."""
        ...


def reject_unknown_options(backend: str, unknown: dict[str, Any], known: tuple[str, ...]) -> None:
    """A backend's ``load(**unknown)`` catch-all: raise ``InvalidInputError`` naming the unknown and known options."""
    if unknown:
        raise InvalidInputError(
            f"unknown {backend} backend option(s) {', '.join(map(repr, sorted(unknown)))}; known: {', '.join(known)}"
        )


# name -> "module:attribute", imported on first use so that listing backends imports none of them.
_REGISTRY: dict[str, str | type] = {"onnxruntime": "layerzero.runtime.backends.onnxruntime:OrtBackend"}
_ALIASES: dict[str, str] = {"ort": "onnxruntime"}


def register_backend(name: str, backend: str | type, *, aliases: tuple[str, ...] = ()) -> None:
    """Register a backend class, or a lazy ``"module:Class"`` reference, under ``name`` and ``aliases``."""
    _REGISTRY[name] = backend
    for alias in aliases:
        _ALIASES[alias] = name


def backend_names() -> list[str]:
    """Registered backend names (aliases excluded)."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> type:
    """The backend class registered as ``name`` (or an alias such as ``"ort"``).

    Raises:
        InvalidInputError: unknown name; the message lists the known ones.
    """
    key = name.lower() if isinstance(name, str) else name
    canonical = _ALIASES.get(key, key)
    if canonical not in _REGISTRY:
        known = ", ".join(f"{n!r}" for n in backend_names())
        aliases = ", ".join(f"{a!r} -> {n!r}" for a, n in sorted(_ALIASES.items()))
        raise InvalidInputError(f"unknown backend {name!r}; known backends: {known} (aliases: {aliases})")
    entry = _REGISTRY[canonical]
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), attr)
        _REGISTRY[canonical] = entry
    return entry
