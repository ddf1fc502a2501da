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
    4. Where ONNX Runtime computes another shape than onnx infers, the shape is dropped (unknown), and so is every
       shape computed from it: ``PRelu`` whose slope is not provably unidirectionally broadcastable to ``X`` (onnx
       infers ``X``'s shape; ONNX Runtime broadcasts both ways: ``PRelu(x[], slope[1])`` is ``[1]``, so a pass
       that trusted ``[]`` changed an output's shape).
    5. ONNX Runtime's contrib ops onnx has no schema for (its inference stops at them, and a model without
       value_info, as ONNX Runtime's own quantizer or a hand-made graph writes, loses every shape past its first
       ``MatMulNBits``): the proto onnx reads holds a standard stand-in of each (``_STAND_INS``) with the same output
       names and shapes, so inference runs through them; their own outputs' shapes come back as any other.
    ``modified`` is True when a type or a shape changed.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            with _weights_by_reference(model):
                proto = ir.serde.serialize_model(model)
            _stand_ins(proto.graph)  # Case 5
            proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
            inferred = ir.serde.deserialize_model(proto)
        except Exception as exc:  # Case 3
            logger.info("shape inference failed, shapes left as they are: %s", exc)
            return ir.passes.PassResult(model, modified=False)
        values = [v for graph in model.graphs() for v in ir.convenience.create_value_mapping(graph).values()]
        before = [(v.type, v.shape) for v in values]
        for graph, inferred_graph in zip(model.graphs(), inferred.graphs()):
            known = ir.convenience.create_value_mapping(inferred_graph)
            for name, value in ir.convenience.create_value_mapping(graph).items():
                other = known.get(name)
                if other is None:
                    continue
                if other.type is not None and (value.type is None or value.type != other.type):  # Case 1
                    value.type = other.type
                if other.shape is not None and value.shape != other.shape:  # Case 2
                    value.shape = other.shape
        _drop_runtime_broadcasts(model)  # Case 4
        modified = any((v.type, v.shape) != old for v, old in zip(values, before))
        return ir.passes.PassResult(model, modified=modified)


# Case 5: the com.microsoft ops given a stand-in (``_stand_ins``): MatMulNBits, and those whose output 0 has input
# 0's shape (the skip norms' output 3, input + skip, too). The stand-in's element type is input 0's, as the op's
# (a float16 MatMulNBits included: the inference does not check types).
_SAME_AS_INPUT = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                  "RotaryEmbedding", "FastGelu", "BiasGelu", "QuickGelu", "Gelu", "BiasAdd", "MoE", "QMoE")  # fmt: skip
_STAND_INS = ("MatMulNBits", *_SAME_AS_INPUT)


def _stand_ins(graph: onnx.GraphProto) -> None:
    """Case 5 on ``graph`` and its subgraphs: each contrib node of ``_STAND_INS`` replaced, in place, by standard
    nodes writing the same output names: ``MatMulNBits(A, ...)`` by ``MatMul(A, w)`` with ``w`` a ``[K, N]``
    placeholder (its data never read: an external reference, as ``_weights_by_reference`` writes), the others'
    output 0 by ``Identity(input 0)`` and a skip norm's output 3 by ``Add(input, skip)``."""
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _stand_ins(sub)
        if node.domain != "com.microsoft" or node.op_type not in _STAND_INS or not node.input or not node.input[0]:
            nodes.append(node)
            continue
        changed = True
        out = list(node.output)
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            k, n = attrs.get("K"), attrs.get("N")
            if k is None or n is None or not out or not out[0]:
                nodes.append(node)
                continue
            w = onnx.TensorProto(name=f"{out[0]}__{_PLACEHOLDER}", data_type=onnx.TensorProto.FLOAT, dims=[k, n],
                                 data_location=onnx.TensorProto.EXTERNAL)  # fmt: skip
            w.external_data.add(key="location", value=_PLACEHOLDER)
            graph.initializer.append(w)
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], w.name], [out[0]]))
            continue
        if out and out[0]:
            nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [out[0]]))
        if node.op_type.startswith("Skip") and len(out) > 3 and out[3] and len(node.input) > 1:
            nodes.append(onnx.helper.make_node("Add", [node.input[0], node.input[1]], [out[3]]))
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)


def _unidirectional(slope: ir.Shape | None, x: ir.Shape | None) -> bool:
    """``slope`` provably broadcasts to ``x`` without changing it (right-aligned, each dim 1 or ``x``'s)."""
    if slope is None or x is None or len(slope) > len(x):
        return False
    return all((isinstance(s, int) and s == 1) or s == d for s, d in zip(reversed(list(slope)), reversed(list(x))))


def _drop_runtime_broadcasts(model: ir.Model) -> None:
    """Case 4: the outputs of ``PRelu`` nodes that ONNX Runtime may broadcast beyond ``X``, and every value
    computed from them (consumers' outputs, transitively, into subgraphs), get an unknown shape."""
    stack = [
        node.outputs[0]
        for graph in model.graphs()
        for node in graph
        if node.op_type == "PRelu"
        and node.domain in ("", "ai.onnx")
        and len(node.inputs) == 2
        and node.inputs[0] is not None
        and node.inputs[1] is not None
        and not _unidirectional(node.inputs[1].shape, node.inputs[0].shape)
    ]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        value.shape = None
        for use in value.uses():
            stack.extend(use.node.outputs)


def infer_shapes(model: ir.Model) -> ir.Model:
    """``InferShapes()`` on ``model`` in place; returns it."""
    InferShapes()(model)
    return model
