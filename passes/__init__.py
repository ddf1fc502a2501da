"""Graph → graph passes on onnx-ir. A pass knows no backend, no CLI and no file system."""

from __future__ import annotations

from layerzero.passes.constant_folding import FoldConstants
from layerzero.passes.dead_code import RemoveDeadCode
from layerzero.passes.uniform_propagation import PropagateUniforms
from layerzero.passes.zero_flags import BypassedLayer, FoldZeroFlags, declared_flags

__all__ = [
    "BypassedLayer",
    "FoldConstants",
    "FoldZeroFlags",
    "PropagateUniforms",
    "RemoveDeadCode",
    "declared_flags",
]
