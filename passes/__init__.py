"""Graph → graph passes on onnx-ir. A pass knows no backend, no CLI and no file system."""

from __future__ import annotations

from layerzero.passes._lattice import uniform_of_constant
from layerzero.passes.algebraic import SimplifyConcatSplit
from layerzero.passes.constant_folding import FoldConstants
from layerzero.passes.dead_code import RemoveDeadCode
from layerzero.passes.shape_inference import InferShapes, infer_shapes
from layerzero.passes.uniform_propagation import PropagateUniforms
from layerzero.passes.zero_flags import BypassedLayer, FoldZeroFlags, declared_flags, flag_regex

__all__ = [
    "BypassedLayer",
    "FoldConstants",
    "FoldZeroFlags",
    "InferShapes",
    "PropagateUniforms",
    "RemoveDeadCode",
    "SimplifyConcatSplit",
    "declared_flags",
    "flag_regex",
    "infer_shapes",
    "uniform_of_constant",
]
