"""onnx's checker on a compiled model: ONNX Runtime's onnx-domain kernels a compile for it writes
(``SimplifiedLayerNormalization``, ``passes/fuse_decoder.py``; ONNX Runtime GenAI's models hold the same op) are no
ONNX operator, so they are checked as a custom domain's, as ``layerzero.loader`` does for a compile input."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from layerzero.loader import _checkable, _ort_kernels


def check_model(model: onnx.ModelProto | ir.Model, full_check: bool = True) -> None:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(_checkable(proto) if _ort_kernels(proto) else proto, full_check=full_check)
