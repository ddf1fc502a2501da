"""``FuseDecoder``: fewer nodes per decode step on ONNX Runtime (issue 22): RMSNorm and rotary embeddings fused.

A decoder step of a small model is mostly tiny elementwise nodes (an RMSNorm is six of them, q / k norms included;
each rotary embedding seven), and ONNX Runtime pays its between-kernel time and thread-pool dispatch per node. This
pass rewrites what transformers' exports write into ONNX Runtime's fused CPU / CUDA kernels. It runs for the
onnxruntime target only, after the lowering and the static passes (``compiler/pipeline.fuse_decoder``), before the
weight quantization; float32 only.

Cases:
1. RMSNorm: ``x * Reciprocal(Sqrt(ReduceMean(x^2, [-1]) + eps))`` (the dynamo form; ``x^2`` as ``Pow(x, 2)`` or
   ``Mul(x, x)``, the reciprocal as ``Div(1, s)``, or ``Div(x, s)``: the TorchScript forms), times an optional
   constant weight of shape ``[D]`` -> ``SimplifiedLayerNormalization(x, w, axis=-1, epsilon=eps)`` (ONNX Runtime's
   kernel in the onnx domain, opset 1: no opset change; a norm without weight gets ``w = 1``). Measured on ONNX
   Runtime 1.32's CPU EP (1 thread, [1, 1, 1024]): 10 us against 20 us for opset-23 ``RMSNormalization`` (which
   needs an opset bump) and 16 us for ``com.microsoft.SkipSimplifiedLayerNormalization`` (79 us at [1, 32, 1024]).
   # x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + eps)) * w  ->  SimplifiedLayerNormalization(x, w)
2. Rotary embedding, the ``rotate_half`` form on a ``[B, N, S, H]`` query or key:
   ``x * cos + Concat(Neg(x[..., H/2:]), x[..., :H/2]) * sin`` with ``cos`` / ``sin`` the ``Unsqueeze(t, [1])`` of a
   ``[B, S, H]`` table whose two halves are provably equal (``Cos`` / ``Sin`` of ``Concat(f, f)``, then elementwise
   scalings and casts) -> ``com.microsoft.RotaryEmbedding(x, ids, cos_cache, sin_cache, interleaved=0)``. Its CPU
   kernel takes 2-D caches indexed by position ids; the export computes the table per token from ``position_ids``,
   so the caches are the tables' first halves flattened to ``[B * S, H / 2]`` and ``ids = arange(B * S)`` as
   ``[B, S]`` (computed once per table, shared by every layer): the same values, no maximum length.
   # x * Unsqueeze(cos, 1) + rotate_half(x) * Unsqueeze(sin, 1)  ->  RotaryEmbedding(x, ids, cos2d, sin2d)

3. The transpose of a key's last two axes that the exporter writes through a 3-D view
   (``Reshape(Transpose(Reshape(k, [-1, T, H]), [0, 2, 1]), [B, N, H, T])``, its shapes computed with Shape / Slice /
   Concat per layer): one ``Transpose(k, [0, 1, 3, 2])`` when ``SymbolicShapes`` proves both views' contents are
   k's dims (merging the two leading axes and splitting them back is the identity).
   # Reshape(Transpose(Reshape(k, [-1, T, H]), [0, 2, 1]), [B, N, H, T])  ->  Transpose(k, [0, 1, 3, 2])

4. Grouped-query attention's ``repeat_kv``: a key / value cache ``[B, Hk, S, D]`` repeated to the query's ``H = Hk * r``
   heads (``Reshape(Expand(Unsqueeze(kv, [2]), [B, Hk, r, S, D]), [B, H, S, D])``, a copy of the whole cache per
   layer and step) read only by the attention's two MatMuls (through the key's Transpose / scalar Mul): each MatMul
   reads the cache as it is and its other operand viewed as ``[B, Hk, r * T, X]`` (head ``h = g * r + j`` of the
   query is row block ``j`` of group ``g``: a view, no copy), its result viewed back to ``[B, H, T, Y]``. The same
   products, no repeated cache: 2 * H * S * D floats a layer and step not written (16 MB at H = 16, D = 64, S = 2,048).
   # MatMul(A, f(Reshape(Expand(Unsqueeze(kv, 2)))))
   #   -> Reshape(MatMul(Reshape(A, [0, Hk, -1, 0]), f(kv)), [0, H, -1, 0])

A candidate that does not match (a square's mean over another axis, no epsilon, a weight of another shape, an
intermediate read elsewhere, a table not provably halved, float16, views not proved, a repeated cache read by
another op) is left as it is with a ``Refusal`` in ``refused`` (kind ``rmsnorm`` / ``rotary`` / ``transpose`` /
``repeat_kv``). A second run changes nothing (no candidate is left).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from layerzero.passes._builder import Builder
from layerzero.passes._fuse_match import (
    const_axes,
    int_attr,
    last_dim,
    only_reader,
    other_input,
    rank_of,
    reshaped_once,
    scalar_of,
    single,
)
from layerzero.passes._graph import NameFactory, const_array, replace_value, same_dim, scope_of
from layerzero.passes._match import NoMatch, Refusal, need
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["KINDS", "FuseDecoder"]

#: What the pass fuses (its ``fused`` counts and its refusals' ``kind``).
KINDS = ("rmsnorm", "rotary", "transpose", "repeat_kv")

logger = logging.getLogger(__name__)

_MS = "com.microsoft"
_FLOAT = ir.DataType.FLOAT


class _Norm:
    """A matched RMSNorm: its input, epsilon, weight (None: 1) and the value it computes."""

    def __init__(self, x: ir.Value, eps: float, weight: np.ndarray | None, weight_value: ir.Value | None,
                 out: ir.Value, nodes: list[ir.Node]) -> None:  # fmt: skip
        self.x, self.eps, self.weight, self.weight_value = x, eps, weight, weight_value
        self.out, self.nodes = out, nodes


def _square_of(node: ir.Node) -> ir.Value | None:
    """``x`` when ``node`` is ``Pow(x, 2)`` or ``Mul(x, x)``, else None."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    if node.op_type == "Pow" and scalar_of(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op_type == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def match_norm(mean: ir.Node) -> _Norm:
    """Case 1 from its ``ReduceMean`` (raises ``NoMatch`` naming the check that failed)."""
    square = mean.inputs[0].producer() if mean.inputs and mean.inputs[0] is not None else None
    x = _square_of(square) if square is not None else None
    need(x is not None and square is not None, "the mean is not of a square", mean)
    assert x is not None and square is not None
    seen: list[ir.Node] = [square, mean]
    need(x.dtype == _FLOAT, f"the input is {x.dtype}, not float32 (the kernel's float16 rounding differs)", *seen)
    rank, dim = rank_of(x), last_dim(x)
    need(rank is not None and dim is not None, "the input's rank or last dim is unknown", *seen)
    assert rank is not None and dim is not None
    axes = const_axes(mean)
    need(axes is not None and [a % rank for a in axes] == [rank - 1],
         f"the mean reduces axes {axes}, not the last one", *seen)  # fmt: skip
    need(int_attr(mean, "keepdims", 1) == 1, "the mean does not keep its dims", *seen)
    only_reader(square.outputs[0], mean, *seen)
    uses = list(mean.outputs[0].uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Add" and not mean.outputs[0].is_graph_output(),
         "no epsilon Add after the mean", *seen)  # fmt: skip
    add = uses[0].node
    seen.append(add)
    eps = scalar_of(other_input(add, mean.outputs[0]))
    need(eps is not None and eps >= 0.0, "the Add after the mean is no constant epsilon >= 0", *seen)
    assert eps is not None
    uses = list(add.outputs[0].uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Sqrt" and not add.outputs[0].is_graph_output(),
         "no Sqrt of mean + eps", *seen)  # fmt: skip
    sqrt = uses[0].node
    seen.append(sqrt)
    uses = list(sqrt.outputs[0].uses())
    need(len(uses) == 1 and not sqrt.outputs[0].is_graph_output(), "the Sqrt is read outside the pattern", *seen)
    after = uses[0].node
    seen.append(after)
    if after.op_type == "Div" and after.inputs[1] is sqrt.outputs[0] and after.inputs[0] is x:
        scaled = after  # x / Sqrt(...)
    else:
        if after.op_type == "Reciprocal":
            inverse = after
        else:
            need(after.op_type == "Div" and after.inputs[1] is sqrt.outputs[0] and scalar_of(after.inputs[0]) == 1.0,
                 f"the Sqrt is read by {after.op_type}, not Reciprocal or 1 / Sqrt", *seen)  # fmt: skip
            inverse = after
        uses = list(inverse.outputs[0].uses())
        need(len(uses) == 1 and uses[0].node.op_type == "Mul" and not inverse.outputs[0].is_graph_output(),
             "the reciprocal is not multiplied once", *seen)  # fmt: skip
        scaled = uses[0].node
        seen.append(scaled)
        need(other_input(scaled, inverse.outputs[0]) is x, "the reciprocal multiplies another value than the input",
             *seen)  # fmt: skip
    out = scaled.outputs[0]
    weight, weight_value = None, None
    uses = list(out.uses())
    if len(uses) == 1 and not out.is_graph_output() and uses[0].node.op_type == "Mul":
        mul = uses[0].node
        w = other_input(mul, out)
        array = const_array(w)
        if array is not None and array.dtype == np.float32 and array.shape == (dim,):
            weight, weight_value, out = array, w, mul.outputs[0]
            seen.append(mul)
    need(out.dtype == _FLOAT, f"the norm's output is {out.dtype}, not float32", *seen)
    return _Norm(x, eps, weight, weight_value, out, seen)


class _Rotary:
    """A matched rotary embedding: its input, the ``[B, S, H]`` cos / sin tables, and the value it computes."""

    def __init__(self, x: ir.Value, cos: ir.Value, sin: ir.Value, out: ir.Value, nodes: list[ir.Node]) -> None:
        self.x, self.cos, self.sin, self.out, self.nodes = x, cos, sin, out, nodes


def _slice_bounds(node: ir.Node, rank: int) -> tuple[int, int] | None:
    """``(start, end)`` of a Slice along the last axis with step 1 (constant inputs), else None."""
    if node.op_type != "Slice" or len(node.inputs) < 3:
        return None
    starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
    axes = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if len(node.inputs) > 3 and node.inputs[3] is not None and (axes is None or axes.size != 1):
        return None
    axis = int(axes.reshape(())) % rank if axes is not None else 0
    if axis != rank - 1 or (steps is not None and (steps.size != 1 or int(steps.reshape(())) != 1)):
        return None
    return int(starts.reshape(())), int(ends.reshape(()))


def _halved_table(value: ir.Value, func: str, seen: list[ir.Node]) -> ir.Value:
    """The ``[B, S, H]`` table under ``Unsqueeze(t, [1])`` = ``value``, when its halves are provably equal: walking
    up through scalar Mul / Div and Casts to float, ``func`` (Cos / Sin) of ``Concat(f, f)`` on the last axis."""
    unsqueeze = single(value.producer(), "Unsqueeze", *seen)
    axes = const_axes(unsqueeze)
    need(axes == [1], f"the {func} table is unsqueezed at {axes}, not [1]", *seen, unsqueeze)
    table = unsqueeze.inputs[0]
    need(table is not None and rank_of(table) == 3, f"the {func} table is not 3-D", *seen, unsqueeze)
    assert table is not None
    current: ir.Value | None = table
    for _ in range(8):
        node = current.producer() if current is not None else None
        need(node is not None, f"the {func} table is no {func} of a computed angle", *seen, unsqueeze)
        assert node is not None
        if node.op_type == func:
            cat = node.inputs[0].producer() if node.inputs[0] is not None else None
            need(cat is not None and cat.op_type == "Concat" and len(cat.inputs) == 2
                 and cat.inputs[0] is cat.inputs[1] and int_attr(cat, "axis", 0) in (-1, 2),
                 f"the {func} table's angle is not Concat(f, f) on the last axis: its halves may differ",
                 *seen, unsqueeze)  # fmt: skip
            return table
        cast = node.op_type == "Cast" and int_attr(node, "to", 0) == _FLOAT.value
        if cast or (node.op_type in ("Mul", "Div") and scalar_of(node.inputs[1]) is not None):
            current = node.inputs[0]
        elif node.op_type == "Mul" and scalar_of(node.inputs[0]) is not None:
            current = node.inputs[1]
        else:
            raise NoMatch(f"the {func} table is computed by {node.op_type}: its halves may differ", *seen, node)
    raise NoMatch(f"the {func} table's chain is too long", *seen)


def match_rotary(neg: ir.Node) -> _Rotary:
    """Case 2 from its ``Neg`` (raises ``NoMatch`` naming the check that failed)."""
    seen: list[ir.Node] = []
    upper = single(neg.inputs[0].producer() if neg.inputs[0] is not None else None, "Slice", neg)
    x = upper.inputs[0]
    seen += [upper, neg]
    need(x is not None and x.dtype == _FLOAT, "the rotated value is not float32", *seen)
    assert x is not None
    rank, head = rank_of(x), last_dim(x)
    need(rank == 4 and head is not None and head % 2 == 0, "the rotated value is not [B, N, S, H], H even", *seen)
    assert head is not None
    half = head // 2
    bounds = _slice_bounds(upper, 4)
    need(bounds is not None and bounds[0] == half and bounds[1] >= head,
         f"the negated slice is {bounds}, not the upper half [{half}:]", *seen)  # fmt: skip
    only_reader(upper.outputs[0], neg, *seen)
    uses = list(neg.outputs[0].uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Concat" and not neg.outputs[0].is_graph_output(),
         "the negated half is not concatenated once", *seen)  # fmt: skip
    cat = uses[0].node
    seen.append(cat)
    need(len(cat.inputs) == 2 and cat.inputs[0] is neg.outputs[0] and int_attr(cat, "axis", 0) in (-1, 3),
         "the Concat is not (-upper, lower) on the last axis", *seen)  # fmt: skip
    lower = single(cat.inputs[1].producer() if cat.inputs[1] is not None else None, "Slice", *seen)
    seen.append(lower)
    need(lower.inputs[0] is x and _slice_bounds(lower, 4) == (0, half), "the Concat's second half is not x[..., :H/2]",
         *seen)  # fmt: skip
    only_reader(lower.outputs[0], cat, *seen)
    uses = list(cat.outputs[0].uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Mul" and not cat.outputs[0].is_graph_output(),
         "rotate_half is not multiplied once", *seen)  # fmt: skip
    mul_sin = uses[0].node
    seen.append(mul_sin)
    sin = other_input(mul_sin, cat.outputs[0])
    uses = list(mul_sin.outputs[0].uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Add" and not mul_sin.outputs[0].is_graph_output(),
         "rotate_half * sin is not added once", *seen)  # fmt: skip
    add = uses[0].node
    seen.append(add)
    mul_cos = single(other_input(add, mul_sin.outputs[0]).producer(), "Mul", *seen)
    seen.append(mul_cos)
    need(x in (mul_cos.inputs[0], mul_cos.inputs[1]), "the Add's other term is not x * cos", *seen)
    only_reader(mul_cos.outputs[0], add, *seen)
    cos = other_input(mul_cos, x)
    need(cos is not None and sin is not None, "no cos / sin", *seen)
    assert cos is not None and sin is not None
    cos_table = _halved_table(cos, "Cos", seen)
    sin_table = _halved_table(sin, "Sin", seen)
    shape_x, shape_c, shape_s = x.shape, cos_table.shape, sin_table.shape
    assert shape_x is not None and shape_c is not None and shape_s is not None
    need(same_dim(shape_c[0], shape_x[0]) and same_dim(shape_c[1], shape_x[2]) and same_dim(shape_c[2], head)
         and all(same_dim(a, b) for a, b in zip(shape_c, shape_s)),
         f"the tables' shape {list(shape_c)} is not provably [B, S, H] of the rotated {list(shape_x)}",
         *seen)  # fmt: skip
    need(add.outputs[0].dtype == _FLOAT, "the rotary output is not float32", *seen)
    return _Rotary(x, cos_table, sin_table, add.outputs[0], seen)


def match_view_transpose(node: ir.Node, shapes: SymbolicShapes) -> tuple[ir.Value, ir.Value]:
    """Case 3 from its ``Transpose`` [0, 2, 1]: ``(k, the value it computes)`` (raises ``NoMatch``)."""
    first = single(node.inputs[0].producer() if node.inputs[0] is not None else None, "Reshape", node)
    seen = [first, node]
    x = first.inputs[0]
    dims = shapes.dims(x)
    need(dims is not None and len(dims) == 4, "the viewed value is not 4-D", *seen)
    assert dims is not None and x is not None
    view = shapes.vector(first.inputs[1])
    need(view is not None and len(view) == 3 and view[1:] == dims[2:] and view[0] in (-1, "-1"),
         f"the 3-D view {view} is not [-1, T, H] of {dims}", *seen)  # fmt: skip
    only_reader(first.outputs[0], node, *seen)
    last = reshaped_once(node.outputs[0], "the transposed view", seen)
    back = shapes.vector(last.inputs[1])
    need(back == [dims[0], dims[1], dims[3], dims[2]], f"the view goes back to {back}, not {dims} transposed", *seen)
    need(all(isinstance(d, str) or d > 0 for d in (*dims, *back)), "a dim of the views is 0", *seen)
    return x, last.outputs[0]


class _Repeat:
    """A matched ``repeat_kv``: the cache, its head counts, the chain from the repeated value to the MatMul that reads
    it (the key's Transpose / scalar Mul, in order) and that MatMul (the repeated operand at its input 1)."""

    def __init__(self, kv: ir.Value, kv_heads: int, heads: int, repeated: ir.Value, chain: list[ir.Node],
                 matmul: ir.Node) -> None:  # fmt: skip
        self.kv, self.kv_heads, self.heads, self.repeated = kv, kv_heads, heads, repeated
        self.chain, self.matmul = chain, matmul


def _head_chain(value: ir.Value, seen: list[ir.Node]) -> tuple[list[ir.Node], ir.Node]:
    """From the repeated cache to the MatMul that reads it at input 1: Transpose (heads kept on axis 1) and
    multiplications by a scalar constant, each read once (raises ``NoMatch``)."""
    chain: list[ir.Node] = []
    while True:
        uses = list(value.uses())
        need(len(uses) == 1 and not value.is_graph_output(), f"{value.name} is read outside the attention", *seen)
        node, idx = uses[0].node, uses[0].idx
        need(node.domain in ("", "ai.onnx"), f"the repeated cache is read by {node.domain}::{node.op_type}", *seen)
        if node.op_type == "MatMul":
            need(idx == 1, "the repeated cache is the MatMul's first operand", *seen, node)
            return chain, node
        if node.op_type == "Transpose":
            perm = node.attributes.get("perm")
            need(perm is not None and list(perm.as_ints())[:2] == [0, 1] and len(perm.as_ints()) == 4,
                 "a Transpose moves the batch or head axis", *seen, node)  # fmt: skip
        else:
            need(node.op_type == "Mul" and scalar_of(other_input(node, value)) is not None,
                 f"the repeated cache is read by {node.op_type}", *seen, node)  # fmt: skip
        chain.append(node)
        value = node.outputs[0]


def match_repeat_kv(expand: ir.Node, shapes: SymbolicShapes) -> _Repeat:
    """Case 4 from its ``Expand`` (raises ``NoMatch``)."""
    unsq = single(expand.inputs[0].producer() if expand.inputs[0] is not None else None, "Unsqueeze", expand)
    seen = [unsq, expand]
    kv = unsq.inputs[0]
    kd = shapes.dims(kv)
    need(kv is not None and kd is not None and len(kd) == 4, "the repeated value is not 4-D", *seen)
    assert kv is not None and kd is not None
    need(kv.dtype == _FLOAT, f"the cache is {kv.dtype}, not float32", *seen)
    axes = const_axes(unsq)
    need(axes is not None and [a % 5 for a in axes] == [2], f"the cache is unsqueezed at {axes}, not 2", *seen)
    only_reader(unsq.outputs[0], expand, *seen)
    ed = shapes.dims(expand.outputs[0])
    need(ed is not None and len(ed) == 5 and [ed[0], ed[1], ed[3], ed[4]] == kd and isinstance(ed[2], int)
         and ed[2] >= 1, f"the Expand to {ed} is not [B, Hk, r, S, D] of {kd}", *seen)  # fmt: skip
    assert ed is not None
    kv_heads, rep = kd[1], int(ed[2])
    need(isinstance(kv_heads, int) and kv_heads >= 1, f"the cache's head count {kv_heads} is not static", *seen)
    assert isinstance(kv_heads, int)
    reshape = reshaped_once(expand.outputs[0], "the expanded cache", seen)
    rd = shapes.dims(reshape.outputs[0])
    need(rd == [kd[0], kv_heads * rep, kd[2], kd[3]], f"the repeated cache is {rd}, not [B, Hk * r, S, D]", *seen)
    chain, matmul = _head_chain(reshape.outputs[0], seen)
    a = shapes.dims(matmul.inputs[0])
    need(a is not None and len(a) == 4 and a[0] == kd[0] and a[1] == kv_heads * rep,
         f"the MatMul's other operand {a} is not [B, H, T, X]", *seen, matmul)  # fmt: skip
    return _Repeat(kv, kv_heads, kv_heads * rep, reshape.outputs[0], chain, matmul)


class FuseDecoder(ir.passes.InPlacePass):
    """RMSNorm -> ``SimplifiedLayerNormalization``, rotary -> ``com.microsoft.RotaryEmbedding`` (module docstring)."""

    def __init__(self, norms: bool = True, rotary: bool = True, transposes: bool = True, repeats: bool = True) -> None:
        super().__init__()
        self.repeats = repeats
        self.norms = norms
        self.rotary = rotary
        self.transposes = transposes
        self.fused: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.refused: list[Refusal] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused = dict.fromkeys(KINDS, 0)
        self.refused = []
        names = NameFactory(model.graph)
        for graph in list(model.graphs()):
            builder = Builder(model.graph, names, _opset(model), node_prefix="/lz_fuse/", value_prefix="lz_fuse.")
            if self.norms:
                self._norms(graph, builder)
            if self.rotary:
                self._rotaries(graph, builder, model)
            if self.transposes:
                self._transposes(graph, builder)
            if self.repeats:
                if self.fused["transpose"]:
                    RemoveDeadCode()(model)  # the transposes' old views still read the repeated key
                self._repeats(graph, builder)
        modified = any(self.fused.values())
        for refusal in self.refused:
            logger.info("FuseDecoder left the %s at %s as it was: %s (%s)", refusal.kind, refusal.path or "the model",
                        refusal.reason, refusal.node)  # fmt: skip
        if modified:
            if any(k == "rotary" for k, n in self.fused.items() if n) and _MS not in model.opset_imports:
                model.opset_imports[_MS] = 1
            RemoveDeadCode()(model)
            logger.info("FuseDecoder: %s fused, %d refused", self.fused, len(self.refused))
        return ir.passes.PassResult(model, modified=modified)

    # ------------------------------------------------------------------------------------------- norms

    def _norms(self, graph: ir.Graph, b: Builder) -> None:
        ones: dict[int, ir.Value] = {}
        for node in list(graph):
            if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
                continue
            square = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
            if square is None or _square_of(square) is None:
                continue  # a mean of something else: no norm
            try:
                norm = match_norm(node)
            except NoMatch as failure:
                self.refused.append(Refusal.of(scope_of(node), failure, "rmsnorm"))
                continue
            dim = last_dim(norm.x)
            assert dim is not None
            if norm.weight_value is not None:
                weight = norm.weight_value
            else:
                if dim not in ones:
                    ones[dim] = b.initializer(f"lz_fuse.rmsnorm_ones_{dim}", np.ones(dim, np.float32))
                weight = ones[dim]
            end = norm.out.producer()
            assert end is not None
            new = b.node("SimplifiedLayerNormalization", [norm.x, weight], {"axis": -1, "epsilon": norm.eps,
                         "stash_type": 1}, name=_name(end, "rmsnorm")).outputs[0]  # fmt: skip
            self._place(graph, b, end, norm.out, new)
            self.fused["rmsnorm"] += 1

    # ------------------------------------------------------------------------------------------ rotary

    def _rotaries(self, graph: ir.Graph, b: Builder, model: ir.Model) -> None:
        caches: dict[int, ir.Value] = {}  # id(table) -> its [B*S, H/2] cache
        ids: dict[int, ir.Value] = {}  # id(cos table) -> arange(B*S) as [B, S]
        for node in list(graph):
            if node.op_type != "Neg" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
                continue
            upper = node.inputs[0].producer() if node.inputs[0] is not None else None
            readers = [u.node.op_type for u in node.outputs[0].uses()]
            if upper is None or upper.op_type != "Slice" or readers != ["Concat"]:
                continue  # no rotate_half
            try:
                need(_opset(model) >= 15, "the model's opset is below 15 (Shape start / end)", node)
                rot = match_rotary(node)
            except NoMatch as failure:
                self.refused.append(Refusal.of(scope_of(node), failure, "rotary"))
                continue
            head = last_dim(rot.x)
            assert head is not None
            for table in (rot.cos, rot.sin):
                if id(table) not in caches:
                    caches[id(table)] = self._cache(graph, b, table, head // 2)
            if id(rot.cos) not in ids:
                ids[id(rot.cos)] = self._ids(graph, b, rot.cos)
            end = rot.out.producer()
            assert end is not None
            new = b.node("RotaryEmbedding", [rot.x, ids[id(rot.cos)], caches[id(rot.cos)], caches[id(rot.sin)]],
                         {"interleaved": 0}, domain=_MS, name=_name(end, "rotary")).outputs[0]  # fmt: skip
            self._place(graph, b, end, rot.out, new)
            self.fused["rotary"] += 1

    def _transposes(self, graph: ir.Graph, b: Builder) -> None:
        shapes: SymbolicShapes | None = None
        for node in list(graph):
            if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
                continue
            perm = node.attributes.get("perm")
            first = node.inputs[0].producer() if node.inputs[0] is not None else None
            if perm is None or list(perm.as_ints()) != [0, 2, 1] or first is None or first.op_type != "Reshape":
                continue
            shapes = SymbolicShapes(graph) if shapes is None else shapes
            try:
                x, out = match_view_transpose(node, shapes)
            except NoMatch as failure:
                self.refused.append(Refusal.of(scope_of(node), failure, "transpose"))
                continue
            end = out.producer()
            assert end is not None
            new = b.node("Transpose", [x], {"perm": [0, 1, 3, 2]}, name=_name(end, "transpose")).outputs[0]
            self._place(graph, b, end, out, new)
            self.fused["transpose"] += 1

    def _repeats(self, graph: ir.Graph, b: Builder) -> None:
        shapes: SymbolicShapes | None = None
        for node in list(graph):
            if node.op_type != "Expand" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
                continue
            first = node.inputs[0].producer() if node.inputs[0] is not None else None
            readers = [u.node.op_type for u in node.outputs[0].uses()]
            if first is None or first.op_type != "Unsqueeze" or const_axes(first) != [2] or readers != ["Reshape"]:
                continue  # not repeat_kv's form (a mask broadcast, an expert's tokens)
            if first.inputs[0] is None or rank_of(first.inputs[0]) != 4:
                continue
            shapes = SymbolicShapes(graph) if shapes is None else shapes
            try:
                rep = match_repeat_kv(node, shapes)
            except NoMatch as failure:
                self.refused.append(Refusal.of(scope_of(node), failure, "repeat_kv"))
                continue
            # The chain again on the cache itself (its nodes act per head: the head axis stays axis 1), the MatMul's
            # other operand viewed per group, the product viewed back: a query head's rows are the same products.
            value, old = rep.kv, rep.repeated
            for link in rep.chain:
                if link.op_type == "Transpose":
                    value = b.op1("Transpose", [value], perm=list(link.attributes["perm"].as_ints()))
                else:
                    value = b.op1("Mul", [value, other_input(link, old)])
                value.dtype, old = _FLOAT, link.outputs[0]
            matmul = rep.matmul
            grouped = b.op1("Reshape", [matmul.inputs[0], b.ints(0, rep.kv_heads, -1, 0)])
            product = b.op1("MatMul", [grouped, value])
            back = b.node("Reshape", [product, b.ints(0, rep.heads, -1, 0)], name=_name(matmul, "repeat_kv"))
            grouped.dtype = product.dtype = _FLOAT
            self._place(graph, b, matmul, matmul.outputs[0], back.outputs[0])
            self.fused["repeat_kv"] += 1

    def _cache(self, graph: ir.Graph, b: Builder, table: ir.Value, half: int) -> ir.Value:
        """``table[..., :half]`` as ``[B * S, half]``, placed after the table's producer."""
        first = b.op1("Slice", [table, b.ints(0), b.ints(half), b.ints(-1)])
        cache = b.op1("Reshape", [first, b.ints(-1, half)])
        cache.dtype, cache.shape = _FLOAT, ir.Shape([None, half])  # type: ignore[list-item]
        _insert_after(graph, table, b.take())
        return cache

    def _ids(self, graph: ir.Graph, b: Builder, table: ir.Value) -> ir.Value:
        """``arange(B * S)`` shaped ``[B, S]`` (the cache's row of each token), placed after the table's producer."""
        dims = b.op1("Shape", [table], start=0, end=2)
        count = b.reduce("ReduceProd", dims, [0], keepdims=0)
        rows = b.op1("Range", [b.const("zero", np.array(0, np.int64)), count, b.const("one", np.array(1, np.int64))])
        ids = b.op1("Reshape", [rows, dims])
        shape = table.shape
        assert shape is not None
        ids.dtype, ids.shape = ir.DataType.INT64, ir.Shape([shape[0], shape[1]])
        _insert_after(graph, table, b.take())
        return ids

    # ------------------------------------------------------------------------------------------- shared

    def _place(self, graph: ir.Graph, b: Builder, end: ir.Node, old: ir.Value, new: ir.Value) -> None:
        """The new nodes go right before the pattern's last node (everything they read is computed by then);
        ``new`` takes ``old``'s type and readers (and its name, when ``old`` is a graph output)."""
        new.type, new.shape = old.type, old.shape
        fused = new.producer()
        assert fused is not None
        fused.metadata_props.update(end.metadata_props)  # the layer's name scopes: scope_of(fused) is end's
        graph.insert_before(end, b.take())
        replace_value(old, new, b.names)


def _opset(model: ir.Model) -> int:
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)))


def _name(node: ir.Node, kind: str) -> str:
    """The fused node's name: the pattern's last node's, suffixed (a path-like name keeps its scope)."""
    return f"{node.name or '/lz_fuse/'}_{kind}"


def _insert_after(graph: ir.Graph, value: ir.Value, nodes: Sequence[ir.Node]) -> None:
    producer = value.producer()
    if producer is not None and producer.graph is graph:
        graph.insert_after(producer, list(nodes))
    elif len(graph):
        graph.insert_before(next(iter(graph)), list(nodes))
    else:
        graph.extend(list(nodes))
