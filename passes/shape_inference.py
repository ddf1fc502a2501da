"""``InferShapes``: onnx shape inference merged back into the model with whole types.

The one shape-inference step of the project: the pipeline runs it before each static iteration and before each
dynamic pass, the TensorRT target before its lowering, ``layerzero inspect`` before matching, and the pass tests
through ``tests/passes/conftest.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import onnx
import onnx_ir as ir

__all__ = ["InferShapes", "infer_shapes"]

logger = logging.getLogger(__name__)

# Initializers above this size are serialised as references, not data: shape inference reads their type and shape
# only (data propagation needs small shape-like constants, which stay inline).
_INLINE_LIMIT = 1024
_PLACEHOLDER = "layerzero-shape-inference-placeholder"


@contextlib.contextmanager
def _weights_by_reference(model: ir.Model) -> Iterator[None]:
    """While inside, big initializers of every graph hold an external-data reference instead of their tensor.

    So the proto onnx's shape inference reads is a header: a large model neither copies its weights nor hits
    protobuf's 2 GB limit. Every tensor is put back on exit, whatever happened.
    """
    saved: list[tuple[ir.Value, ir.TensorProtocol]] = []
    try:
        for graph in model.graphs():
            for value in graph.initializers.values():
                tensor = value.const_value
                if tensor is None or tensor.nbytes <= _INLINE_LIMIT:
                    continue
                saved.append((value, tensor))
                value.const_value = ir.ExternalTensor(
                    _PLACEHOLDER, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=value.name
                )
        yield
    finally:
        for value, tensor in saved:
            value.const_value = tensor


class InferShapes(ir.passes.InPlacePass):
    """Run onnx's ``infer_shapes`` (no type check, not strict, data propagation) and merge what it found.

    The model is serialised with its big initializers as references (``_weights_by_reference``): onnx's public
    API on a header-sized proto, with no private onnx-ir helper.

    Cases:
    1. A value whose inferred type differs (a sequence or an optional, not only a tensor's dtype) takes the whole
       type: onnx-ir's ``ShapeInferencePass`` copies dtype and shape only, so a value onnx infers to be a sequence
       would come back as a plain tensor, which ONNX Runtime then rejects.
    2. A value whose inferred shape differs takes that shape. Subgraphs are merged too (``model.graphs()``).
    3. Inference that fails leaves the model as it was (inference helps the passes, it is never required).
    ``modified`` is True when a type or a shape changed.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            with _weights_by_reference(model):
                proto = ir.serde.serialize_model(model)
            proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
            inferred = ir.serde.deserialize_model(proto)
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
