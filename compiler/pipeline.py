"""Which passes run, in what order: the static passes to a bounded fixpoint."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import onnx_ir as ir

from layerzero.groups import ApplyGroupSpec
from layerzero.options import CompileOptions
from layerzero.passes import (
    BypassedLayer,
    FoldConstants,
    FoldZeroFlags,
    PropagateUniforms,
    RemoveDeadCode,
    SimplifyConcatSplit,
)
from layerzero.passes.gated_branches import SkipGatedBranches
from layerzero.passes.moe import SkipExperts
from layerzero.passes.solidify_paths import DropExperts, RemoveSkippedBranches

if TYPE_CHECKING:
    from layerzero.targets.base import Target

__all__ = [
    "DYNAMIC_PASSES",
    "PipelineResult",
    "bypass_declared_layers",
    "lower_for_target",
    "needs_dynamic_reference",
    "run_dynamic_passes",
    "run_static_passes",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PipelineResult:
    iterations: int
    converged: bool
    modified_by: dict[str, int]  # pass name -> iterations in which it changed the model
    bypassed: list[BypassedLayer]


def _infer_shapes(model: ir.Model) -> None:
    """onnx shape inference, merged back with whole types (not only dtype and shape).

    onnx-ir's ShapeInferencePass copies dtype and shape only, so a value onnx infers to be a
    sequence or an optional would come back as a plain tensor, which ORT then rejects.
    """
    import onnx
    from onnx_ir.passes.common import _c_api_utils

    def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)

    try:
        inferred = ir.serde.deserialize_model(_c_api_utils.call_onnx_api(infer, model))
    except Exception as exc:  # inference is a help, never a requirement
        logger.info("shape inference failed, shapes left as they are: %s", exc)
        return
    for graph, inferred_graph in zip(model.graphs(), inferred.graphs()):
        known = ir.convenience.create_value_mapping(inferred_graph)
        for name, value in ir.convenience.create_value_mapping(graph).items():
            other = known.get(name)
            if other is None:
                continue
            if other.type is not None and (value.type is None or value.type != other.type):
                value.type = other.type
            if other.shape is not None and value.shape != other.shape:
                value.shape = other.shape


def run_static_passes(
    model: ir.Model,
    options: CompileOptions,
    on_iteration: Callable[[int], None] | None = None,
) -> PipelineResult:
    """flags → constants → uniforms → DCE, repeated until no pass changes the model."""
    flags = FoldZeroFlags(options.flag_pattern)
    passes: list[ir.passes.PassBase] = [
        flags,
        FoldConstants(options.fold_max_elements),
        PropagateUniforms(options.assume_finite),
        SimplifyConcatSplit(),
        RemoveDeadCode(),
    ]
    modified_by = {type(p).__name__: 0 for p in passes}
    converged = False
    iteration = 0
    for iteration in range(1, options.max_iterations + 1):
        _infer_shapes(model)
        changed = False
        for p in passes:
            if p(model).modified:
                modified_by[type(p).__name__] += 1
                changed = True
        if on_iteration is not None:
            on_iteration(iteration)
        if not changed:
            converged = True
            break
    if not converged:
        logger.warning("static passes did not reach a fixpoint in %d iterations", options.max_iterations)
    return PipelineResult(iteration, converged, modified_by, list(flags.bypassed))


def bypass_declared_layers(model: ir.Model, options: CompileOptions) -> list[BypassedLayer]:
    """The verification reference for declared flags: only those layers bypassed, nothing else.

    With a group spec (``options.groups``), each group's layers are also bypassed where its router
    says so, computed densely (``Where``), since skipping them changes the output on purpose.
    """
    _infer_shapes(model)
    flags = FoldZeroFlags(options.flag_pattern)
    flags(model)
    RemoveDeadCode()(model)
    if needs_dynamic_reference(options):
        from layerzero.groups import apply_group_reference

        _infer_shapes(model)
        apply_group_reference(model, options)
    return list(flags.bypassed)


def needs_dynamic_reference(options: CompileOptions) -> bool:
    """Whether verification compares against a reference built by ``bypass_declared_layers``."""
    return options.dynamic and options.groups is not None


# Dynamic passes: each built as Class(options) and run once, in order, after the static fixpoint. A pass records
# what it made dynamic with ``layerzero.passes._dynamic.record_dynamic_path``; the target then lowers the skipping
# forms (``lower_for_target``) and the static passes run once more to clean up. A new dynamic pass is one line here.
DYNAMIC_PASSES: list[type[ir.passes.PassBase]] = [
    # Group masks first: a group's scopes must still be plain layers (no other pass's mask inside).
    # The spec is read here, in the compiler (passes know no file system).
    ApplyGroupSpec,
    # MoE: rewrite each block into the skipping form ai.layerzero::MoE (each target lowers it afterwards).
    SkipExperts,
    # Solidify (options.solidify, from a profile): drop experts from the skipping form, before lowering.
    DropExperts,
    # Gated branches last: an MoE's weighted expert sum looks like x + g * f(x) too (here it is one MoE node).
    SkipGatedBranches,
    # Solidify: gates and groups always skipped take their else path (constant folding inlines it).
    RemoveSkippedBranches,
]


def run_dynamic_passes(model: ir.Model, options: CompileOptions) -> bool:
    """Run the registered dynamic passes; returns whether any changed the model."""
    if not options.dynamic:
        return False
    modified = False
    for cls in DYNAMIC_PASSES:
        _infer_shapes(model)
        modified |= cls(options)(model).modified
    return modified


def lower_for_target(model: ir.Model, options: CompileOptions, target: Target) -> bool:
    """The target's lowering of the skipping forms (``Target.lower``); returns whether it changed the model."""
    _infer_shapes(model)  # lowerings read dtypes and shapes
    return target.lower(model, options)
