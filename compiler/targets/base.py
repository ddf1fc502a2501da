"""The target interface: what a compile target decides, in one small class.

A target (``onnxruntime``, ``tensorrt``) says how the compiled graph is lowered for it, what the compile's
numerical verification compares (a graph ONNX Runtime can run), how its bundle is written and which runtime
backend runs that bundle. ``compile_model`` / ``compile_file`` ask the target, never test its name; a new target
is one module in this package plus one line in the registry (``layerzero.targets.TARGET_CLASSES``).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from layerzero.errors import InvalidInputError

if TYPE_CHECKING:
    import onnx_ir as ir

    from layerzero.options import CompileOptions
    from layerzero.result import CompileResult

__all__ = ["BundleWrite", "Progress", "Target"]

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class BundleWrite:
    """What ``Target.write_bundle`` passes on to the target's ``_write_bundle``, besides ``out`` and ``result``."""

    source: Path | None
    sha256: str | None
    overwrite: bool
    progress: Progress | None
    #: An instance of the target's ``options_type``, or None (its defaults).
    target_options: Any


class Target(abc.ABC):
    """One compile target. Instances hold no state; ``layerzero.targets.get_target(name)`` returns one."""

    #: ``CompileOptions.target`` / ``layerzero compile --target`` name; the manifest's ``target``.
    name: ClassVar[str]
    #: The runtime backend (``layerzero.runtime.backends`` registry name) that runs this target's bundles;
    #: ``CompileResult.manifest`` writes it as ``backend``, where ``Engine.load`` reads it.
    backend: ClassVar[str]
    #: The type of this target's own build options (``write_bundle``'s ``target_options``); None: it takes none.
    options_type: ClassVar[type | None] = None

    def check_available(self) -> None:  # noqa: B027 (a default, not an abstract step)
        """Raise before any work when this target cannot build here (a missing toolkit); default: always can."""

    @abc.abstractmethod
    def lower(self, model: ir.Model, options: CompileOptions) -> bool:
        """Lower the target-independent forms the passes made (``ai.layerzero::MoE``) in place, after the dynamic
        passes; returns whether the model changed (the static passes then clean up)."""

    def verification_model(self, model: ir.Model, options: CompileOptions) -> ir.Model:
        """The graph the compile's verification runs with ONNX Runtime in place of ``model``; default: ``model``."""
        return model

    def write_bundle(
        self,
        out: str | os.PathLike[str],
        result: CompileResult,
        *,
        source: Path | None,
        sha256: str | None,
        overwrite: bool = False,
        progress: Progress | None = None,
        target_options: Any = None,
    ) -> dict[str, Any]:
        """Write the bundle for ``result`` at ``out`` atomically (nothing on failure); returns its manifest.

        ``target_options``: this target's own build options (an ``options_type``, e.g. ``TensorRTOptions``), None
        for its defaults; anything else is an ``InvalidInputError`` before any work.
        """
        wanted = self.options_type
        if target_options is not None and (wanted is None or not isinstance(target_options, wanted)):
            takes = "no options" if wanted is None else wanted.__name__
            raise InvalidInputError(f"target {self.name!r} takes {takes}, got {type(target_options).__name__}")
        return self._write_bundle(out, result, BundleWrite(source, sha256, overwrite, progress, target_options))

    @abc.abstractmethod
    def _write_bundle(self, out: str | os.PathLike[str], result: CompileResult, how: BundleWrite) -> dict[str, Any]:
        """``write_bundle`` once ``how.target_options`` is checked: write the bundle, return its manifest."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.backend!r})"
