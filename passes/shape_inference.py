"""``InferShapes``: onnx shape inference merged back into the model with whole types.

The one shape-inference step of the project: the pipeline runs it before each static iteration and before each
dynamic pass, the TensorRT target before its lowering, ``layerzero inspect`` before matching, and the pass tests
through ``tests/passes/conftest.py``.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

# NOTE: onnx-ir's own route to the onnx C API (initializers above a size limit are left out while onnx serialises
# the model, so a large model neither copies its weights nor hits protobuf's 2 GB limit). onnx-ir 1.1 exposes it
# only as this module; re-implementing it here would duplicate it.
from onnx_ir.passes.common import _c_api_utils

__all__ = ["InferShapes", "infer_shapes"]

logger = logging.getLogger(__name__)


class InferShapes(ir.passes.InPlacePass):
    """Run ``onnx.shape_inference`` (no type check, not strict, data propagation) and merge what it found.

    Cases:
    1. A value whose inferred type differs (a sequence or an optional, not only a tensor's dtype) takes the whole
       type: onnx-ir's ``ShapeInferencePass`` copies dtype and shape only, so a value onnx infers to be a sequence
       would come back as a plain tensor, which ONNX Runtime then rejects.
    2. A value whose inferred shape differs takes that shape. Subgraphs are merged too (``model.graphs()``).
    3. Inference that fails leaves the model as it was (inference helps the passes, it is never required).
    ``modified`` is True when a type or a shape changed.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
            return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)

        try:
            inferred = ir.serde.deserialize_model(_c_api_utils.call_onnx_api(infer, model))
        except Exception as exc:  # Case 3
            logger.info("shape inference failed, shapes left as they are: %s", exc)
            return ir.passes.PassResult(model, modified=False)
        modified = False
        for graph, inferred_graph in zip(model.graphs(), inferred.graphs()):
            known = ir.convenience.create_value_mapping(inferred_graph)
            for name, value in ir.convenience.create_value_mapping(graph).items():
                other = known.get(name)
                if other is None:
                    continue
                if other.type is not None and (value.type is None or value.type != other.type):  # Case 1
                    value.type = other.type
                    modified = True
                if other.shape is not None and value.shape != other.shape:  # Case 2
                    value.shape = other.shape
                    modified = True
        return ir.passes.PassResult(model, modified=modified)


def infer_shapes(model: ir.Model) -> ir.Model:
    """``InferShapes()`` on ``model`` in place; returns it."""
    InferShapes()(model)
    return model
