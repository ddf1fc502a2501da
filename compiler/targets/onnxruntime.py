"""The ONNX Runtime target (the default): standard and ``com.microsoft`` ops, run by the ``onnxruntime`` backend.

Lowering: every ``ai.layerzero::MoE`` node becomes ONNX Runtime ops (``passes/lower_moe.py``: per-expert ``If``
subgraphs or ``com.microsoft.MoE``, ``CompileOptions.moe_lowering``), for the device the bundle runs on
(``CompileOptions.device``: on cuda only ``com.microsoft.MoE``, never ``If``). Verification compares the compiled
graph itself (on the CPU). The bundle is ``model.onnx`` (+ external data) and ``manifest.json``
(``runtime/bundle.py``), which records the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from layerzero.errors import UnsupportedModelError
from layerzero.targets.base import BundleWrite, Target

if TYPE_CHECKING:
    import onnx_ir as ir

    from layerzero.options import CompileOptions
    from layerzero.result import CompileResult

__all__ = ["OnnxRuntimeTarget"]


class OnnxRuntimeTarget(Target):
    """Bundles ONNX Runtime runs: the compiled graph with its MoE blocks lowered to ONNX Runtime ops."""

    name = "onnxruntime"
    backend = "onnxruntime"

    def lower(self, model: ir.Model, options: CompileOptions) -> bool:
        """Lower every ``ai.layerzero::MoE`` node for ``options.device``.

        Cases:
        1. cpu: ``LowerMoE`` with ``options.moe_lowering``; auto picks the native op when liblayerzero_ort.so is
           built (``layerzero plugins build``), else by the cost model.
        2. cuda: ``com.microsoft.MoE`` for every block, never per-expert ``If`` (ONNX Runtime's CUDA ``If``
           reads its condition on the host: a copy and a sync per expert would serialise them). A block the op
           cannot compute is refused (``UnsupportedModelError`` naming it and why), before anything changes.
        """
        from layerzero.passes.lower_moe import LowerMoE

        if options.device == "cuda":
            return _lower_for_cuda(model)
        from layerzero.plugins.ort_library import find_ort_library

        lower = LowerMoE(lowering=options.moe_lowering, enabled=True, native_present=find_ort_library() is not None)
        return lower(model).modified

    def _write_bundle(self, out: str | os.PathLike[str], result: CompileResult, how: BundleWrite) -> dict[str, Any]:
        import onnx_ir as ir

        from layerzero.runtime.bundle import write_bundle

        if how.progress is not None:
            how.progress("writing bundle")
        manifest = result.manifest(how.source, how.sha256)
        manifest["device"] = result.options.device  # Engine.load picks the execution provider from it
        # Weights that came memory-mapped from external data stay external: they are copied file to file. Saved
        # into one protobuf they would be read into memory and serialised, several times their size at peak.
        mapped = any(isinstance(v.const_value, ir.ExternalTensor) for v in result.model.graph.initializers.values())
        write_bundle(
            out,
            result.model,
            manifest,
            overwrite=how.overwrite,
            protect=[] if how.source is None else [how.source],
            **({"external_threshold_bytes": 0} if mapped else {}),
        )
        return manifest


def _lower_for_cuda(model: ir.Model) -> bool:
    """Case 2 of ``OnnxRuntimeTarget.lower``."""
    from layerzero.passes._moe_node import MoENode, is_moe_node
    from layerzero.passes.lower_moe import LowerMoE, ort_moe_supports

    for node in model.graph:
        if not is_moe_node(node):
            continue
        view = MoENode.of(node)
        why = ort_moe_supports(view.scoring, view.activation, view.zeroing_threshold)
        if why is not None:
            raise UnsupportedModelError(
                f"MoE block {view.path!r}: device 'cuda' lowers MoE to com.microsoft.MoE only, "
                f"which cannot run it: {why}; compile it with --device cpu"
            )
    lower = LowerMoE(lowering="ort-moe", enabled=True, native_present=False)
    modified = lower(model).modified
    other = [path for path, lowering in lower.lowered if lowering != "ort-moe"]
    if other:  # ort_moe_supports said yes above: LowerMoE and it disagree
        raise UnsupportedModelError(f"MoE blocks {other}: not lowered to com.microsoft.MoE for device 'cuda'")
    return modified
