"""Which passes run, in what order: the static passes to a bounded fixpoint."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from layerzero.options import CompileOptions
from layerzero.passes import (
    BypassedLayer,
    FoldConstants,
    FoldZeroFlags,
    PropagateUniforms,
    RemoveDeadCode,
)

__all__ = ["PipelineResult", "bypass_declared_layers", "run_static_passes"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PipelineResult:
    iterations: int
    converged: bool
    modified_by: dict[str, int]  # pass name -> iterations in which it changed the model
    bypassed: list[BypassedLayer]


def _infer_shapes(model: ir.Model) -> None:
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)


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
    """The verification reference for declared flags: only those layers bypassed, nothing else."""
    _infer_shapes(model)
    flags = FoldZeroFlags(options.flag_pattern)
    flags(model)
    RemoveDeadCode()(model)
    return list(flags.bypassed)


# Dynamic passes: each entry is "module:Class", built as Class(options) and run once, in order,
# after the static fixpoint. A pass records what it made dynamic with
# ``layerzero.passes._dynamic.record_dynamic_path``; the static passes then run once more to clean up.
DYNAMIC_PASSES: list[str] = []


def run_dynamic_passes(model: ir.Model, options: CompileOptions) -> bool:
    """Run the registered dynamic passes; returns whether any changed the model."""
    import importlib

    if not options.dynamic:
        return False
    modified = False
    for spec in DYNAMIC_PASSES:
        module_name, _, class_name = spec.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        _infer_shapes(model)
        modified |= cls(options)(model).modified
    return modified
