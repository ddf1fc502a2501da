"""``NativeRouter``: a MoE block's router into its ``ai.layerzero::MoE`` node (liblayerzero_ort.so; ``layerzero
compile --weights int4|int8 --linear-kernel native``).

Why: once the attention is one node (``native_attention.py``), five of a Qwen3-MoE int4 decode layer's 13 nodes are
the router's bookkeeping: the Reshape of the hidden state to ``[T, H]``, the router's Gemm, the confidence's
Softmax and ReduceMax (``layerzero::router::<path>``, what the report and the profile read), and the Reshape of the
block's output back to ``[B, T, H]``: each a few µs of ONNX Runtime's time between kernels for a few KB of work.
The native op computes the logits itself (its float row kernels over the router's ``[E, H]`` weight), writes the
confidence as its output 3 and reads / writes the hidden state in the block's own shape.

The pattern, for each ``ai.layerzero::MoE`` node (``MoENode``)::

    logits = Gemm(x2, W, b?, transA=0, transB=1, alpha=1, beta=1)   # or MatMul(x2, Wt)
    c = ReduceMax(Softmax(logits, axis=-1) | Sigmoid(logits), axes=[-1], keepdims=0)   # optional: the confidence
    y, mask[, kept] = MoE(x2, logits, ...)

with ``x2`` the node's hidden state, W (Wt) a constant float32 ``[E, H]`` (``[H, E]``), b a constant ``[E]``, the
logits read by the node and the confidence only, the Softmax / Sigmoid by its ReduceMax only, the scoring the
node's own. -> ``y, mask, kept | "", c = MoE(x2, "", ..., router_weight=W, router_bias=b)`` (inputs 15-16, output 3;
the semantics: ``plugins/reference.py``). Then, where ``x2 = Reshape(x3)`` is read by the node alone and ``y`` by a
single Reshape whose output provably has x3's shape (``SymbolicShapes``), the node reads x3 and writes that output.

The logits are the same float32 products summed in another order than ONNX Runtime's Gemm (an expert choice can flip
only on a near tie); the verification's quantized-dense reference gets this pass too (``compiler/compile.py``).
``unfold_router`` puts the logits back in the graph (``force_off.py``'s profiling variant rewrites them).
A second run changes nothing (no node with router logits is left).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.contract import ROUTER_PREFIX
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._fuse_match import int_attr
from layerzero.passes._graph import NameFactory, const_array, replace_value
from layerzero.passes._moe_node import INPUTS, ROUTER_SLOTS, MoENode, is_moe_node
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["CONFIDENCE_OUTPUT", "NativeRouter", "unfold_router"]

#: The MoE node's output that carries the confidence once the router is in the op.
CONFIDENCE_OUTPUT = 3
_STD = ("", "ai.onnx")


def _float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else float(attr.as_float())


def _router_weights(logits: ir.Value, x: ir.Value) -> tuple[np.ndarray, np.ndarray | None, ir.Node] | None:
    """``(W [E, H], b [E] | None, node)`` when ``logits`` = x @ W^T (+ b) by a Gemm or MatMul of constants."""
    node = logits.producer()
    if node is None or node.domain not in _STD or not node.inputs or node.inputs[0] is not x:
        return None
    if node.op_type == "Gemm":
        if int_attr(node, "transA", 0) or not int_attr(node, "transB", 0):
            return None
        if _float_attr(node, "alpha", 1.0) != 1.0 or _float_attr(node, "beta", 1.0) != 1.0:
            return None
        weight = const_array(node.inputs[1])
        bias = const_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if len(node.inputs) > 2 and node.inputs[2] is not None and bias is None:
            return None
    elif node.op_type == "MatMul" and len(node.inputs) == 2:
        weight = const_array(node.inputs[1])
        weight = weight.T if weight is not None and weight.ndim == 2 else None
        bias = None
    else:
        return None
    if weight is None or weight.ndim != 2 or weight.dtype != np.float32:
        return None
    if bias is not None:
        if bias.dtype != np.float32 or bias.size != weight.shape[0] or bias.ndim > 1:
            return None
        bias = bias.reshape(-1)
    return np.ascontiguousarray(weight), bias, node


def _confidence(logits: ir.Value, moe: ir.Node, scoring: str) -> tuple[bool, ir.Value | None]:
    """``(True, c)``: the confidence output read from ``logits`` (None when there is none); ``(False, None)`` when
    the logits have another reader."""
    want = "Softmax" if scoring == "softmax" else "Sigmoid"
    found: ir.Value | None = None
    for use in logits.uses():
        reader = use.node
        if reader is moe:
            continue
        if found is not None or reader.op_type != want or reader.domain not in _STD or logits.is_graph_output():
            return False, None
        if want == "Softmax" and int_attr(reader, "axis", -1) not in (-1, 1):
            return False, None
        scores = reader.outputs[0]
        readers = list(scores.uses())
        if scores.is_graph_output() or len(readers) != 1 or readers[0].node.op_type != "ReduceMax":
            return False, None
        reduce = readers[0].node
        axes = const_array(reduce.inputs[1]) if len(reduce.inputs) > 1 else None
        attr = reduce.attributes.get("axes")
        axes = axes if axes is not None else (np.array(attr.as_ints()) if attr is not None else None)
        if axes is None or [int(a) for a in axes.reshape(-1)] not in ([-1], [1]) or int_attr(reduce, "keepdims", 1):
            return False, None
        out = reduce.outputs[0]
        if not out.is_graph_output() or not (out.name or "").startswith(ROUTER_PREFIX) or list(out.uses()):
            return False, None
        found = out
    return True, found


def _same_view(moe: ir.Node, view: MoENode, gemm: ir.Node, shapes: SymbolicShapes) -> tuple[ir.Value, ir.Value] | None:
    """``(x3, y3)``: the block's hidden state and output in their own shape, when ``x2 = Reshape(x3)`` feeds only the
    node and its router and the node's output is read by one Reshape back to x3's shape; else None."""
    x2, y2 = view.hidden, moe.outputs[0]
    flatten = x2.producer()
    if flatten is None or flatten.op_type != "Reshape" or flatten.domain not in _STD or x2.is_graph_output():
        return None
    if any(use.node not in (moe, gemm) for use in x2.uses()):
        return None
    x3 = flatten.inputs[0]
    readers = list(y2.uses())
    if x3 is None or y2.is_graph_output() or len(readers) != 1:
        return None
    back = readers[0].node
    if back.op_type != "Reshape" or back.domain not in _STD or readers[0].idx != 0:
        return None
    y3 = back.outputs[0]
    return (x3, y3) if shapes.same_shape(x3, y3) else None


class NativeRouter(ir.passes.InPlacePass):
    """Each MoE block's router into its native node (module docstring). ``fused``: the paths of the nodes that now
    compute their router."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused = []
        names = NameFactory(model.graph)
        b = Builder(model.graph, names, model_opset(model))
        graph = model.graph
        shapes: SymbolicShapes | None = None
        for moe in [n for n in graph if is_moe_node(n)]:
            view = MoENode.of(moe)
            if view.logits is None or view.routing != "topk" or view.hidden.dtype != ir.DataType.FLOAT:
                continue
            found = _router_weights(view.logits, view.hidden)
            if found is None:
                continue
            weight, bias, gemm = found
            ok, confidence = _confidence(view.logits, moe, view.scoring)
            if not ok:
                continue
            shapes = SymbolicShapes(graph) if shapes is None else shapes
            same = _same_view(moe, view, gemm, shapes)
            view.logits = None  # type: ignore[assignment]
            view.router_weight = b.initializer(f"{view.path}.router.weight", weight)
            view.router_bias = b.initializer(f"{view.path}.router.bias", bias) if bias is not None else None
            if same is not None:
                view.hidden = same[0]
            self._rewrite(graph, b, moe, view, confidence, same[1] if same is not None else None)
            self.fused.append(view.path)
        if self.fused:
            RemoveDeadCode()(model)
        return ir.passes.PassResult(model, modified=bool(self.fused))

    @staticmethod
    def _rewrite(graph: ir.Graph, b: Builder, moe: ir.Node, view: MoENode, confidence: ir.Value | None,
                 y3: ir.Value | None) -> None:  # fmt: skip
        node = view.to_node(name=moe.name, metadata_props=dict(moe.metadata_props), outputs=4)
        olds = list(moe.outputs) + [None] * (4 - len(moe.outputs))
        olds[0] = y3 if y3 is not None else olds[0]
        olds[CONFIDENCE_OUTPUT] = confidence
        for old, new in zip(olds, node.outputs):
            if old is None:
                new.name = ""  # an absent optional output
                continue
            new.name = b.names(f"{old.name}.native") if old.name else None
            new.dtype, new.shape, new.type = old.dtype, old.shape, old.type
        graph.insert_before(moe, node)
        for old, new in zip(olds, node.outputs):
            if old is not None:
                replace_value(old, new, b.names)


def unfold_router(graph: ir.Graph, node: ir.Node, names: NameFactory) -> ir.Value | None:
    """The router logits ``[T, E]`` of a MoE node that computes its router (``NativeRouter``), back in the graph:
    ``Gemm(Reshape(hidden, [-1, H]), router_weight, router_bias, transB=1)`` as its input 1, its inputs 15-16
    emptied (its confidence output then reads those logits). None for a node without its router."""
    view = MoENode.of(node)
    if view.router_weight is None:
        return None
    weight = const_array(view.router_weight)
    if weight is None:
        return None
    b = Builder(graph, names, 0, node_prefix=f"/{view.path}/router/Lz", value_prefix=f"{view.path}.router.")
    flat = b.op1("Reshape", [view.hidden, b.ints(-1, int(weight.shape[1]))])
    flat.dtype = ir.DataType.FLOAT
    inputs = [flat, view.router_weight] + ([view.router_bias] if view.router_bias is not None else [])
    logits = b.node("Gemm", inputs, {"transB": 1}).outputs[0]
    logits.dtype = ir.DataType.FLOAT
    graph.insert_before(node, b.take())
    for slot in ROUTER_SLOTS:
        if slot < len(node.inputs):
            node.replace_input_with(slot, None)
    node.replace_input_with(INPUTS.index("logits"), logits)
    return logits
