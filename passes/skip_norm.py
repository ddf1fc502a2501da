"""``FuseSkipNorm``: a residual ``Add`` and the RMS norm after it into ONNX Runtime's
``com.microsoft.SkipSimplifiedLayerNormalization`` (``layerzero compile --weights int4|int8 --linear-kernel native``).

Why: a decoder layer adds each branch back to the residual stream and normalises the sum for the next branch
(``SimplifiedLayerNormalization`` after ``FuseDecoder``): two nodes where ONNX Runtime has one kernel that writes
both the normalised value and the sum (its output 3). Its own graph fusion leaves these pairs (the sum has a second
reader, the next residual Add); at batch-1 decode each node is a few µs of ONNX Runtime's time for 4 KB of work.

The pattern::

    s = Add(a, b)                      # a, b float32 of one provable rank-3 shape (SymbolicShapes): no broadcast
    y = SimplifiedLayerNormalization(s, gamma, axis=-1, stash_type=1)     # gamma a constant [H]

-> ``y, "", "", s' = SkipSimplifiedLayerNormalization(a, b, gamma, epsilon)`` with the Add's other readers (and a
graph output) reading ``s'`` (output 3, written only when something reads it). The same sum; the norm in ONNX
Runtime's fused kernel (float32 rounding of the unfused one: the quantized-dense reference gets this pass too).
"""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._fuse_match import int_attr
from layerzero.passes._graph import NameFactory, const_array, replace_value
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["FuseSkipNorm"]

_STD = ("", "ai.onnx")
_FLOAT = ir.DataType.FLOAT


def _norm_after(add: ir.Node) -> ir.Node | None:
    """The one SimplifiedLayerNormalization over the last axis (constant 1-D gamma) reading the Add's output."""
    found = None
    for use in add.outputs[0].uses():
        node = use.node
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in _STD or use.idx != 0:
            continue
        gamma = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if int_attr(node, "axis", -1) not in (-1, 2) or int_attr(node, "stash_type", 1) != 1 or len(node.outputs) != 1:
            continue
        if gamma is None or gamma.ndim != 1 or found is not None:
            return None
        found = node
    return found


class FuseSkipNorm(ir.passes.InPlacePass):
    """Residual Add + RMS norm pairs into ``SkipSimplifiedLayerNormalization`` (module docstring). ``fused``: the
    new nodes' names."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused = []
        graph = model.graph
        names = NameFactory(graph)
        shapes: SymbolicShapes | None = None
        for add in list(graph):
            if add.op_type != "Add" or add.domain not in _STD or add.graph is not graph or len(add.inputs) != 2:
                continue
            a, b = add.inputs
            norm = _norm_after(add)
            if norm is None or a is None or b is None or a.dtype != _FLOAT or b.dtype != _FLOAT:
                continue
            shapes = SymbolicShapes(graph) if shapes is None else shapes
            dims = shapes.dims(a)
            if dims is None or len(dims) != 3 or not shapes.same_shape(a, b):
                continue
            gamma = const_array(norm.inputs[1])
            if gamma is None or not isinstance(dims[2], int) or gamma.shape != (dims[2],):
                continue
            eps = norm.attributes.get("epsilon")
            builder = Builder(graph, names, model_opset(model), metadata=norm.metadata_props)
            node = builder.node("SkipSimplifiedLayerNormalization", [a, b, norm.inputs[1]],
                                {"epsilon": float(eps.value) if eps is not None else 1e-5}, domain="com.microsoft",
                                outputs=4, name=f"{norm.name or '/lz_fuse/'}_skip")  # fmt: skip
            s, y = add.outputs[0], norm.outputs[0]
            total = node.outputs[3]
            for new, old in ((node.outputs[0], y), (total, s)):
                new.dtype, new.shape, new.type = old.dtype, old.shape, old.type
            node.outputs[1].name = node.outputs[2].name = ""
            graph.insert_before(add, builder.take())
            replace_value(y, node.outputs[0], names)
            others = [u for u in s.uses() if u.node is not norm]
            if others or s.is_graph_output():
                replace_value(s, total, names)
            else:
                total.name = ""
            self.fused.append(node.name or "")
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
            RemoveDeadCode()(model)
        return ir.passes.PassResult(model, modified=bool(self.fused))
