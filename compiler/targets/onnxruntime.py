"""The ONNX Runtime target (the default): standard and ``com.microsoft`` ops, run by the ``onnxruntime`` backend.

Lowering: every ``ai.layerzero::MoE`` node becomes ONNX Runtime ops (``passes/lower_moe.py``: per-expert ``If``
subgraphs or ``com.microsoft.MoE``, ``CompileOptions.moe_lowering``). Verification compares the compiled graph
itself. The bundle is ``model.onnx`` (+ external data) and ``manifest.json`` (``runtime/bundle.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerzero.errors import InvalidInputError
from layerzero.targets.base import Progress, Target

if TYPE_CHECKING:
    import onnx_ir as ir

    from layerzero.compile import CompileResult
    from layerzero.options import CompileOptions

__all__ = ["OnnxRuntimeTarget"]


class OnnxRuntimeTarget(Target):
    """Bundles ONNX Runtime runs: the compiled graph with its MoE blocks lowered to ONNX Runtime ops."""

    name = "onnxruntime"
    backend = "onnxruntime"

    def lower(self, model: ir.Model, options: CompileOptions) -> bool:
        from layerzero.passes.lower_moe import LowerMoE
        from layerzero.plugins.ort_library import find_ort_library

        # auto picks the native op when liblayerzero_ort.so is built (`layerzero plugins build`).
        lower = LowerMoE(lowering=options.moe_lowering, enabled=True, native_present=find_ort_library() is not None)
        return lower(model).modified

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
        import onnx_ir as ir

        from layerzero.runtime.bundle import write_bundle

        if target_options is not None:
            raise InvalidInputError(
                f"target {self.name!r} takes no options, got {type(target_options).__name__}"
            )
        if progress is not None:
            progress("writing bundle")
        manifest = result.manifest(source, sha256)
        # Weights that came memory-mapped from external data stay external: they are copied file to file. Saved
        # into one protobuf they would be read into memory and serialised, several times their size at peak.
        mapped = any(isinstance(v.const_value, ir.ExternalTensor) for v in result.model.graph.initializers.values())
        write_bundle(
            out,
            result.model,
            manifest,
            overwrite=overwrite,
            protect=[] if source is None else [source],
            **({"external_threshold_bytes": 0} if mapped else {}),
        )
        return manifest
