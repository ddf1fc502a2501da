"""Symbolic shapes derived from a node's own operands, for the value lattice (passes/_lattice.py).

Shape inference names the dims of graph inputs, but TorchScript exports leave almost every
intermediate dim unnamed (``unk__N``), so two dims that are the same run-time size carry different
names. This module derives each value's dims from its producer's operands with the op's shape rule
(broadcast, contraction, Reshape/Expand/Concat/Gather/..., and the *contents* of small int64 shape
tensors built from ``Shape``), and merges what it proves with what inference named, in one
union-find over dim keys. Two dims are provably equal when their keys share a class.

Every class remembers the values that carry it, so a uniform can be materialised with ``Shape`` of
a value that exists at run time (a graph input where possible) instead of a dim name.

Rules beyond the op's own shape function (each a small function below; unknown is no fact, never a guess):
- ``reshape_wildcard``: a Reshape's ``-1`` is the operand's element count over the target's other dims
  (split heads ``[b, s, 64] -> [b, s, -1, 16]`` gives 4, merge heads gives 64 back);
- ``slice_length`` / ``split_lengths``: exact lengths of Slice / Split along a static axis, the whole axis
  for ``[0:INT_MAX]`` of a symbolic one;
- shape-vector contents through ``ConstantOfShape``, elementwise ``Add/Sub/Mul/Div/Equal/Max/Min``
  (``vector_elementwise``: a symbolic element is a size, so never negative) and ``Where``
  (``vector_where``): torch's ``expand(b, -1, s, s)`` becomes ``[b, 1, s, s]`` again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array

__all__ = [
    "Dim",
    "SymbolicShapes",
    "reshape_wildcard",
    "slice_length",
    "split_lengths",
    "vector_elementwise",
    "vector_where",
]

logger = logging.getLogger(__name__)

Dim = int | str  # a static size, or the key of a union-find class of equal run-time sizes

# Ops whose output 0 has the shape of input 0.
_SAME_AS_INPUT = frozenset(
    {
        "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cast", "CastLike", "Ceil", "Celu", "Clip",
        "Cos", "Cosh", "CumSum", "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish",
        "Hardmax", "Identity", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax",
        "LpNormalization", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid",
        "Sign", "Sin", "Sinh", "SimplifiedLayerNormalization", "Softmax", "Softplus", "Softsign", "Sqrt",
        "Tan", "Tanh", "ThresholdedRelu", "Trilu", "BitwiseNot", "RMSNormalization", "GroupNormalization",
        "InstanceNormalization", "BatchNormalization", "MeanVarianceNormalization",
    }
)  # fmt: skip
_BROADCAST = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "And", "Or", "Xor", "Equal", "Greater", "GreaterOrEqual",
        "Less", "LessOrEqual", "Where", "Sum", "Max", "Min", "Mean", "PRelu", "BitShift", "BitwiseAnd",
        "BitwiseOr", "BitwiseXor",
    }
)  # fmt: skip
_SHAPE_VECTOR_MAX = 16  # int64 tensors longer than this are not shape vectors
_VECTOR_DTYPES = (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL)
_VECTOR_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Equal", "Max", "Min"})


def reshape_wildcard(source: list[Dim], known: list[Dim]) -> Dim | None:
    """The size a Reshape's ``-1`` stands for: the element count of ``source`` over that of ``known``.

    ``source`` is the operand's dims, ``known`` the target's other dims (both canonical). Each side is
    a static product times a multiset of symbolic classes; the classes of ``known`` must all cancel
    against ``source``'s (``[b, s, 64] -> [b, s, -1, 16]``: ``-1`` is 4; ``[b, s, h, 16] -> [b, s, -1]``
    with ``h`` = 4: 64). The quotient is an int, or one class when exactly one is left with factor 1
    (``[b, s] -> [-1, s]``: ``b``); anything else (a product of classes) is None: no fact.
    """
    left = [d for d in source if not isinstance(d, int)]
    for d in known:
        if isinstance(d, int):
            continue
        if d not in left:
            return None
        left.remove(d)
    num = int(np.prod([d for d in source if isinstance(d, int)], dtype=np.int64))
    den = int(np.prod([d for d in known if isinstance(d, int)], dtype=np.int64))
    if den <= 0 or num % den:
        return None
    ratio = num // den
    if not left:
        return ratio
    if len(left) == 1 and ratio == 1:
        return left[0]
    return None


def slice_length(dim: Dim, start: int, end: int, step: int) -> Dim | None:
    """Length of ``dim`` sliced ``[start:end:step]`` (ONNX clamps like Python's ``slice.indices``).

    A static ``dim`` gives the exact count; a symbolic one only the whole axis
    (``[0:INT_MAX:1]`` and the like, which torch.onnx writes for ``x[:, :]``); otherwise None.
    """
    if step == 0:
        return None
    if isinstance(dim, int):
        return len(range(dim)[slice(start, end, step)])
    big = 2**31 - 1  # exporters write INT_MAX or INT64_MAX for "to the end"
    if step == 1 and start in (0,) and end >= big:
        return dim
    if step == 1 and start <= -big and end >= big:
        return dim
    return None


def split_lengths(dim: Dim, sizes: list[int] | None, parts: int) -> list[Dim | None]:
    """Lengths of the ``parts`` outputs of Split along an axis of size ``dim``.

    Explicit ``sizes`` (the ``split`` input or attribute) are the lengths. Without them the axis is cut
    into equal parts (opset 18: the last part takes the remainder of ``ceil(dim / parts)`` chunks); a
    symbolic axis cut into one part keeps its dim, into several gives no fact.
    """
    if sizes is not None:
        return list(sizes) if len(sizes) == parts else [None] * parts
    if parts == 1:
        return [dim]
    if not isinstance(dim, int):
        return [None] * parts
    chunk = -(-dim // parts)
    out: list[Dim | None] = [chunk] * (parts - 1)
    out.append(dim - chunk * (parts - 1))
    return out if out[-1] >= 0 else [None] * parts  # type: ignore[operator]


def vector_elementwise(op: str, a: list[Dim], b: list[Dim]) -> list[Dim] | None:
    """Contents of ``op(a, b)`` for two shape vectors (1-element vectors broadcast); None when unknown.

    Symbolic elements are run-time sizes, so they are >= 0: ``Equal(s, -1)`` is 0 (false), ``Equal(s, s)``
    is 1, ``s * 1``, ``s + 0``, ``s - 0`` and ``s / 1`` are ``s``, ``s * 0`` is 0. Any element that cannot
    be stated that way makes the whole result unknown (an unknown element is never given a fresh size:
    it may be negative).
    """
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    n = max(len(a), len(b))
    a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
    out: list[Dim] = []
    for x, y in zip(a, b):
        r = _element(op, x, y)
        if r is None:
            return None
        out.append(r)
    return out


def _element(op: str, x: Dim, y: Dim) -> Dim | None:
    both = isinstance(x, int) and isinstance(y, int)
    if op == "Equal":
        if both or x == y:
            return int(x == y)
        other = y if isinstance(y, int) else x if isinstance(x, int) else None
        return 0 if other is not None and other < 0 else None  # a size is never negative
    if op == "Add":
        return x + y if both else x if y == 0 else y if x == 0 else None  # type: ignore[operator]
    if op == "Sub":
        return x - y if both else x if y == 0 else 0 if x == y else None  # type: ignore[operator]
    if op == "Mul":
        if both:
            return x * y  # type: ignore[operator]
        if 0 in (x, y):
            return 0
        return x if y == 1 else y if x == 1 else None
    if op == "Div":
        if both:
            return x // y if x >= 0 and y > 0 else None  # type: ignore[operator]  # (ONNX truncates; Python floors)
        return x if y == 1 else None
    if op in ("Max", "Min") and both:
        return max(x, y) if op == "Max" else min(x, y)  # type: ignore[type-var]
    return None


def vector_where(cond: list[Dim], x: list[Dim], y: list[Dim]) -> list[Dim] | None:
    """Contents of ``Where(cond, x, y)`` over shape vectors whose condition is known element by element."""
    n = max(len(cond), len(x), len(y))
    if any(len(v) not in (1, n) for v in (cond, x, y)):
        return None
    cond, x, y = (v * n if len(v) == 1 else v for v in (cond, x, y))
    if not all(isinstance(c, int) for c in cond):
        return None
    return [xi if c else yi for c, xi, yi in zip(cond, x, y)]


class SymbolicShapes:
    """Dims of every value of a graph (and its subgraphs), proved from operands and inference."""

    def __init__(self, graph: ir.Graph, graphs: Iterable[ir.Graph] | None = None) -> None:
        self._parent: dict[str, str] = {}
        self._static: dict[str, int] = {}
        self._carriers: dict[str, list[tuple[ir.Value, int]]] = {}
        self._dims: dict[ir.Value, list[Dim] | None] = {}
        self._vectors: dict[ir.Value, list[Dim]] = {}  # contents of small int shape tensors
        self._fresh = itertools.count()
        self._root = graph
        for value in graph.inputs:
            self._set(value, self._from_inference(value))
        for g in graphs if graphs is not None else [graph]:
            for value in g.inputs:
                if value not in self._dims:
                    self._set(value, self._from_inference(value))
            for node in g:
                self._visit(node)

    # ------------------------------------------------------------------ union-find
    def _find(self, key: str) -> str:
        parent = self._parent.setdefault(key, key)
        if parent == key:
            return key
        root = self._find(parent)
        self._parent[key] = root
        return root

    def _union(self, a: Dim, b: Dim) -> Dim:
        if isinstance(a, int) and isinstance(b, int):
            return a
        if isinstance(a, int):
            a, b = b, a
        ra = self._find(a)  # type: ignore[arg-type]
        if isinstance(b, int):
            if ra not in self._static:
                self._static[ra] = b
            return self.canon(ra)
        rb = self._find(b)
        if ra != rb:
            self._parent[rb] = ra
            if rb in self._static and ra not in self._static:
                self._static[ra] = self._static[rb]
            self._carriers.setdefault(ra, []).extend(self._carriers.pop(rb, []))
        return self.canon(ra)

    def canon(self, dim: Dim) -> Dim:
        """The static size of ``dim``'s class when known, else the class key."""
        if isinstance(dim, int):
            return dim
        root = self._find(dim)
        return self._static.get(root, root)

    def _new(self) -> str:
        return f"#{next(self._fresh)}"

    # ------------------------------------------------------------------ queries
    def dims(self, value: ir.Value | None) -> list[Dim] | None:
        """Canonical dims of ``value`` (None when its rank is unknown)."""
        if value is None:
            return None
        if value not in self._dims:
            self._set(value, self._from_inference(value))
        dims = self._dims[value]
        return None if dims is None else [self.canon(d) for d in dims]

    def same_shape(self, a: ir.Value, b: ir.Value) -> bool:
        """True when both values provably have the same dtype and shape."""
        if a.dtype is None or a.dtype != b.dtype:
            return False
        da, db = self.dims(a), self.dims(b)
        return da is not None and db is not None and da == db

    def carriers(self, dim: Dim) -> list[tuple[ir.Value, int]]:
        """(value, axis) pairs whose size is ``dim`` at run time: graph inputs first."""
        if isinstance(dim, int):
            return []
        found = self._carriers.get(self._find(dim), [])
        return sorted(found, key=lambda c: 0 if c[0].is_graph_input() else 1)

    def vector(self, value: ir.Value | None) -> list[Dim] | None:
        """Contents of a small 1-D int shape tensor, as dims (None when not traced)."""
        if value is None:
            return None
        if value in self._vectors:
            return [self.canon(d) for d in self._vectors[value]]
        array = const_array(value)
        if array is not None and array.dtype.kind in "iub" and array.ndim <= 1 and array.size <= _SHAPE_VECTOR_MAX:
            return [int(x) for x in array.reshape(-1)]
        return None

    # ------------------------------------------------------------------ building
    def _from_inference(self, value: ir.Value) -> list[Dim] | None:
        if value.shape is None:
            return None
        dims: list[Dim] = []
        for dim in value.shape:
            if isinstance(dim, int):
                dims.append(dim)
            elif isinstance(getattr(dim, "value", None), str):
                dims.append(f"name:{dim.value}")
            else:
                dims.append(self._new())
        return dims

    def _set(self, value: ir.Value, dims: list[Dim] | None) -> None:
        inferred = self._from_inference(value)
        if dims is None:
            dims = inferred
        elif inferred is not None and len(inferred) == len(dims):
            # What the rule proved and what inference named are the same sizes. A static size on
            # either side stays this value's own: it never pins a whole class of symbolic dims.
            dims = [
                self._union(d, i)
                if not isinstance(d, int) and not isinstance(i, int)
                else i
                if isinstance(i, int)
                else d
                for d, i in zip(dims, inferred)
            ]
        elif inferred is not None:
            logger.debug("rank of %s: inference says %d, the operands %d", value.name, len(inferred), len(dims))
            dims = inferred
        self._dims[value] = dims
        for axis, dim in enumerate(dims or ()):
            if not isinstance(dim, int):
                self._carriers.setdefault(self._find(dim), []).append((value, axis))

    def _visit(self, node: ir.Node) -> None:
        outs: list[list[Dim] | None] = [None] * len(node.outputs)
        if node.domain in ("", "ai.onnx") and node.outputs:
            try:
                outs = self._rule(node) or outs
            except Exception as exc:  # a malformed node: fall back to inference for it
                logger.debug("shape rule of %s (%s) failed: %s", node.name, node.op_type, exc)
        for out, dims in zip(node.outputs, outs):
            self._set(out, dims)
        if node.domain in ("", "ai.onnx") and node.outputs:
            with _suppress():
                self._value_rule(node)

    def _in(self, node: ir.Node, k: int) -> list[Dim] | None:
        return self.dims(node.inputs[k]) if k < len(node.inputs) and node.inputs[k] is not None else None

    def broadcast(self, shapes: list[list[Dim] | None]) -> list[Dim] | None:
        """Multidirectional broadcast of dims (None when a rank is unknown)."""
        if any(s is None for s in shapes):
            return None
        rank = max((len(s) for s in shapes), default=0)  # type: ignore[arg-type]
        out: list[Dim] = []
        for axis in range(rank):
            column = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]  # type: ignore[index,arg-type]
            column = [self.canon(d) for d in column]
            big = {d for d in column if isinstance(d, int) and d != 1}
            symbolic = {d for d in column if not isinstance(d, int)}
            if len(big) == 1:
                out.append(next(iter(big)))
            elif big:
                return None  # not broadcastable (or 0 against n): leave it to inference
            elif len(symbolic) == 1:
                out.append(next(iter(symbolic)))
            elif not symbolic:
                out.append(1)
            else:
                out.append(self._new())
        return out

    def _rule(self, node: ir.Node) -> list[list[Dim] | None] | None:
        op = node.op_type
        attrs = node.attributes
        if op in _SAME_AS_INPUT:
            return [self._in(node, 0)] + [None] * (len(node.outputs) - 1)
        if op in _BROADCAST:
            return [self.broadcast([self._in(node, k) for k in range(len(node.inputs))])]
        if op in ("MatMul", "MatMulInteger"):
            a, b = self._in(node, 0), self._in(node, 1)
            if a is None or b is None or len(a) < 2 or len(b) < 2:
                return None
            self._union(a[-1], b[-2])  # the contraction requires it
            batch = self.broadcast([a[:-2], b[:-2]])
            return None if batch is None else [[*batch, a[-2], b[-1]]]
        if op == "Gemm":
            a, b = self._in(node, 0), self._in(node, 1)
            if a is None or b is None or len(a) != 2 or len(b) != 2:
                return None
            ta, tb = attrs.get_int("transA", 0), attrs.get_int("transB", 0)
            self._union(a[0] if ta else a[1], b[1] if tb else b[0])
            return [[a[1] if ta else a[0], b[0] if tb else b[1]]]
        if op == "Transpose":
            a = self._in(node, 0)
            if a is None:
                return None
            perm = attrs.get_ints("perm", list(range(len(a)))[::-1])
            return [[a[p] for p in perm]]
        if op in ("Unsqueeze", "Squeeze"):
            return [self._unsqueeze(node)]
        if op in ("Reshape", "ConstantOfShape", "Expand"):
            return [self._shaped(node)]
        if op == "Concat":
            return [self._concat(node)]
        if op == "Gather":
            data, idx = self._in(node, 0), self._in(node, 1)
            if data is None or idx is None:
                return None
            axis = attrs.get_int("axis", 0) % len(data)
            return [[*data[:axis], *idx, *data[axis + 1 :]]]
        if op == "Tile":
            a, repeats = self._in(node, 0), const_array(node.inputs[1])
            if a is None or repeats is None or repeats.size != len(a):
                return None
            tiled: list[Dim] = []
            for d, r in zip(a, (int(r) for r in repeats.reshape(-1))):
                d = self.canon(d)
                tiled.append(d if r == 1 else d * r if isinstance(d, int) else self._new())
            return [tiled]
        if op in ("Slice", "Split"):
            return self._sliced(node)
        if op == "Range":
            start, delta = const_array(node.inputs[0]), const_array(node.inputs[2])
            limit = self.vector(node.inputs[1])
            if start is not None and delta is not None and int(start) == 0 and int(delta) == 1 and limit:
                return [[limit[0]]]
            return None
        if op == "Shape":
            a = self._in(node, 0)
            return None if a is None else [[len(self._shape_slice(node, a))]]
        if op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2"):
            return [self._reduced(node)]
        return None

    def _axes(self, node: ir.Node, k: int) -> list[int] | None:
        if "axes" in node.attributes:
            return list(node.attributes.get_ints("axes", []))
        if k < len(node.inputs) and node.inputs[k] is not None:
            array = const_array(node.inputs[k])
            return None if array is None else [int(x) for x in array.reshape(-1)]
        return []

    def _unsqueeze(self, node: ir.Node) -> list[Dim] | None:
        a, axes = self._in(node, 0), self._axes(node, 1)
        if a is None or axes is None:
            return None
        if node.op_type == "Squeeze":
            if not axes:
                return None
            drop = {x % len(a) for x in axes}
            return [d for i, d in enumerate(a) if i not in drop]
        rank = len(a) + len(axes)
        put = {x % rank for x in axes}
        rest = iter(a)
        return [1 if i in put else next(rest) for i in range(rank)]

    def _shaped(self, node: ir.Node) -> list[Dim] | None:
        target = self.vector(node.inputs[1] if node.op_type != "ConstantOfShape" else node.inputs[0])
        if target is None:
            return None
        if node.op_type == "ConstantOfShape":
            return target
        a = self._in(node, 0)
        if node.op_type == "Expand":
            return self.broadcast([a, target])
        if a is None:
            return None
        allowzero = node.attributes.get_int("allowzero", 0)
        out: list[Dim] = []
        wildcard = None
        for i, d in enumerate(target):
            if d == 0 and not allowzero:
                if i >= len(a):
                    return None
                out.append(a[i])
            elif d == -1:
                wildcard = i
                out.append(-1)
            else:
                out.append(d)
        if wildcard is not None:
            # [b, s, 64] -> [b, s, -1, 16]: the -1 is what the element count leaves (reshape_wildcard)
            known = [self.canon(d) for i, d in enumerate(out) if i != wildcard]
            size = reshape_wildcard([self.canon(d) for d in a], known)
            out[wildcard] = self._new() if size is None else size
        return out

    def _concat(self, node: ir.Node) -> list[Dim] | None:
        shapes = [self.dims(v) for v in node.inputs]
        if not shapes or any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:  # type: ignore[arg-type]
            return None
        rank = len(shapes[0])  # type: ignore[arg-type]
        axis = node.attributes.get_int("axis", 0) % rank
        out: list[Dim] = []
        for i in range(rank):
            column = [s[i] for s in shapes]  # type: ignore[index]
            if i == axis:
                sizes = [self.canon(d) for d in column]
                out.append(sum(sizes) if all(isinstance(d, int) for d in sizes) else self._new())  # type: ignore[arg-type]
                continue
            dim = column[0]
            for other in column[1:]:  # Concat requires every other axis to match
                dim = self._union(dim, other)
            out.append(dim)
        return out

    def _sliced(self, node: ir.Node) -> list[list[Dim] | None] | None:
        a = self._in(node, 0)
        if a is None:
            return None
        a = [self.canon(d) for d in a]
        if node.op_type == "Split":
            axis = node.attributes.get_int("axis", 0) % len(a)
            sizes = self._split_sizes(node)
            lengths = split_lengths(a[axis], sizes, len(node.outputs))
            return [[*a[:axis], self._new() if n is None else n, *a[axis + 1 :]] for n in lengths]
        axes = self._axes(node, 3)
        if axes is None:
            return None
        starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
        if not axes:  # no axes: the first len(starts) axes (all of them when starts is unknown)
            axes = list(range(len(a) if starts is None else min(len(a), starts.size)))
        axes = [x % len(a) for x in axes]
        count = len(axes)
        bounds: dict[int, tuple[int, int, int]] = {}
        if starts is not None and ends is not None and starts.size == ends.size == count:
            step_list = [1] * count if steps is None else [int(x) for x in steps.reshape(-1)]
            if len(step_list) == count:
                for axis, b, e, st in zip(axes, starts.reshape(-1), ends.reshape(-1), step_list):
                    bounds[axis] = (int(b), int(e), st)
        out: list[Dim] = []
        for i, d in enumerate(a):
            if i not in axes:
                out.append(d)
                continue
            n = slice_length(d, *bounds[i]) if i in bounds else None
            out.append(self._new() if n is None else n)
        return [out]

    def _split_sizes(self, node: ir.Node) -> list[int] | None:
        """The explicit ``split`` sizes of a Split (input 1 from opset 13, the attribute before)."""
        if "split" in node.attributes:
            return list(node.attributes.get_ints("split", []))
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            array = const_array(node.inputs[1])
            return None if array is None else [int(x) for x in array.reshape(-1)]
        return None

    def _reduced(self, node: ir.Node) -> list[Dim] | None:
        a = self._in(node, 0)
        axes = self._axes(node, 1)
        if a is None or axes is None or not axes:
            return None
        keep = node.attributes.get_int("keepdims", 1)
        chosen = {x % len(a) for x in axes}
        if keep:
            return [1 if i in chosen else d for i, d in enumerate(a)]
        return [d for i, d in enumerate(a) if i not in chosen]

    @staticmethod
    def _shape_slice(node: ir.Node, dims: list[Dim]) -> list[Dim]:
        rank = len(dims)
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        start = max(0, min(rank, start + rank if start < 0 else start))
        end = max(0, min(rank, end + rank if end < 0 else end))
        return dims[start:end]

    # ------------------------------------------------------------------ shape-tensor contents
    def _value_rule(self, node: ir.Node) -> None:
        op = node.op_type
        out = node.outputs[0]
        result: list[Dim] | None = None
        if op == "Shape":
            a = self._in(node, 0)
            result = None if a is None else self._shape_slice(node, a)
        elif op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape") and out.dtype in _VECTOR_DTYPES:
            result = self.vector(node.inputs[0])
            if result is not None and out.dtype == ir.DataType.BOOL:  # Cast to bool: nonzero -> 1
                result = [int(d != 0) for d in result] if all(isinstance(d, int) for d in result) else None
            if result is not None and op in ("Reshape", "Unsqueeze", "Squeeze"):
                # The contents keep their order; a result of rank > 1 is no vector. A Reshape of unknown
                # rank keeps a 1-element vector only (a scalar <-> [1]).
                dims = self.dims(out)
                if (dims is not None and len(dims) > 1) or (dims is None and op == "Reshape" and len(result) != 1):
                    result = None
        elif op == "ConstantOfShape":
            # ConstantOfShape([n]) filled with an integer: n copies (the "ones" of expand(-1) handling)
            target = self.vector(node.inputs[0])
            attr = node.attributes.get("value")
            fill = attr.as_tensor().numpy() if attr is not None else np.zeros(1, np.float32)
            if target is not None and len(target) == 1 and isinstance(target[0], int) and fill.dtype.kind in "iub":
                result = [int(fill.reshape(-1)[0])] * target[0]
        elif op in _VECTOR_ELEMENTWISE and len(node.inputs) == 2:
            a, b = self.vector(node.inputs[0]), self.vector(node.inputs[1])
            if a is not None and b is not None:
                result = vector_elementwise(op, a, b)
        elif op == "Where":
            cond, x, y = (self.vector(v) for v in node.inputs)
            if cond is not None and x is not None and y is not None:
                result = vector_where(cond, x, y)
        elif op == "Gather":
            data, idx = self.vector(node.inputs[0]), const_array(node.inputs[1])
            if data is not None and idx is not None and idx.ndim <= 1:
                result = [data[int(i)] for i in idx.reshape(-1)]
        elif op == "Concat":
            parts = [self.vector(v) for v in node.inputs]
            if all(p is not None for p in parts):
                result = [d for p in parts for d in p]  # type: ignore[union-attr]
        elif op == "Slice":
            data = self.vector(node.inputs[0])
            starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
            steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
            if data is not None and starts is not None and ends is not None and starts.size == 1:
                step = 1 if steps is None else int(steps.reshape(-1)[0])
                result = data[int(starts.reshape(-1)[0]) : int(np.clip(ends.reshape(-1)[0], -(2**62), 2**62)) : step]
        if result is not None and len(result) <= _SHAPE_VECTOR_MAX:
            self._vectors[out] = result


class _suppress:
    """Contents tracing is a help: a malformed node leaves its output untraced."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)  # type: ignore[arg-type]
