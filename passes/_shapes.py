"""Symbolic shapes derived from a node's own operands, for the value lattice (passes/_lattice.py).

Shape inference names the dims of graph inputs, but TorchScript exports leave almost every
intermediate dim unnamed (``unk__N``), so two dims that are the same run-time size carry different
names. This module derives each value's dims from its producer's operands with the op's shape rule
(broadcast, contraction, Reshape/Expand/Concat/Gather/..., and the *contents* of small int64 shape
tensors built from ``Shape``), and merges what it proves with what inference named, in one
union-find over dim keys. Two dims are provably equal when their keys share a class.

Every class remembers the values that carry it, so a uniform can be materialised with ``Shape`` of
a value that exists at run time (a graph input where possible) instead of a dim name.

The one evaluator of integer vectors (shape tensors, bounds, sizes) of ``passes/``: its rules and op table are
in ``passes/_shape_rules.py`` (unknown is no fact, never a guess). Built on a graph, it proves every value's
dims and vectors in order; built without one (``SymbolicShapes()``), it answers on demand from inference's
dims and the producers (``ints``: structured zeros' bounds; ``static_vector``: the MoE matcher's shape
arithmetic, with the nodes it read).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._shape_rules import (
    SHAPE_VECTOR_MAX,
    VECTOR_RULES,
    Dim,
    reshape_wildcard,
    shape_slice,
    slice_length,
    split_lengths,
    split_sizes,
    vector_elementwise,
    vector_where,
)

__all__ = [
    "Dim",
    "SymbolicShapes",
    "reshape_wildcard",
    "slice_length",
    "split_lengths",
    "split_sizes",
    "vector_elementwise",
    "vector_where",
]

logger = logging.getLogger(__name__)

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


class SymbolicShapes:
    """Dims of every value of a graph (and its subgraphs), proved from operands and inference; the contents of
    its small integer tensors. Without a graph: dims from inference, contents evaluated on demand."""

    def __init__(self, graph: ir.Graph | None = None, graphs: Iterable[ir.Graph] | None = None) -> None:
        self._parent: dict[str, str] = {}
        self._static: dict[str, int] = {}
        self._carriers: dict[str, list[tuple[ir.Value, int]]] = {}
        self._dims: dict[ir.Value, list[Dim] | None] = {}
        # contents of small int shape tensors (None elements: not known), None when evaluated and unknown
        self._vectors: dict[ir.Value, list[Dim | None] | None] = {}
        self._reads: dict[ir.Value, tuple[ir.Node, ...]] = {}  # the nodes a value's contents were read from
        self._reading: list[list[ir.Node]] = []  # the nodes read by the rules being evaluated
        self._fresh = itertools.count()
        if graph is None:
            return
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
        """Contents of a small 1-D int shape tensor, as dims (None when not every element is known)."""
        found = self.partial(value)
        return None if found is None or any(d is None for d in found) else found  # type: ignore[return-value]

    def ints(self, value: ir.Value | None) -> list[int | None] | None:
        """Contents of a small int tensor as static ints (None entries: sizes not known at compile time)."""
        found = self.partial(value)
        return None if found is None else [d if isinstance(d, int) else None for d in found]

    def static_vector(self, value: ir.Value | None) -> tuple[list[int], tuple[ir.Node, ...]] | None:
        """Contents known to the last element at compile time, with the nodes they were computed by (the
        producers the evaluation read, constants aside); None otherwise."""
        found = self.ints(value)
        if found is None or any(d is None for d in found):
            return None
        return found, self._reads.get(value, ())  # type: ignore[return-value]

    def partial(self, value: ir.Value | None, depth: int = 0) -> list[Dim | None] | None:
        """Contents of a small int tensor, an element None where not known; None when not traced. Evaluated once
        per value (``VECTOR_RULES`` of its producer), from constants, dims and the operands' contents."""
        if value is None:
            return None
        if value in self._vectors:
            found = self._vectors[value]
        else:
            found = self._evaluate(value, depth)
        if self._reading:
            reading = self._reading[-1]
            reading.extend(n for n in self._reads.get(value, ()) if n not in reading)
        return None if found is None else [self.canon(d) if isinstance(d, str) else d for d in found]

    def _evaluate(self, value: ir.Value, depth: int) -> list[Dim | None] | None:
        array = const_array(value)
        if array is not None:
            found = None
            if array.dtype.kind in "iub" and array.ndim <= 1 and array.size <= SHAPE_VECTOR_MAX:
                found = [int(x) for x in array.reshape(-1)]
            self._vectors[value] = found
            return found
        node = value.producer()
        rule = None if node is None or node.domain not in ("", "ai.onnx") else VECTOR_RULES.get(node.op_type)
        if rule is None or value is not node.outputs[0] or depth > _MAX_DEPTH:  # type: ignore[union-attr]
            return None  # not memoised past the depth: a shallower question may get the answer
        operands = _Depth(self, depth + 1)
        with self._read(node) as reads:  # type: ignore[arg-type]
            try:
                found = rule(node, operands)  # type: ignore[arg-type]
            except Exception as exc:  # a malformed node: its output is not traced
                logger.debug("vector rule of %s (%s) failed: %s", node.name, node.op_type, exc)  # type: ignore[union-attr]
                found = None
            if found is not None and node.op_type != "Shape":  # (Shape reads its operand's dims, not contents)
                # What computes the other operands (a Reshape's shape, the axes) is read too.
                for operand in node.inputs:  # type: ignore[union-attr]
                    operands.partial(operand)
        if found is not None and len(found) > SHAPE_VECTOR_MAX:
            found = None
        self._vectors[value] = found
        self._reads[value] = tuple(reads)
        return found

    @contextmanager
    def _read(self, node: ir.Node) -> Iterator[list[ir.Node]]:
        reads = [node]
        self._reading.append(reads)
        try:
            yield reads
        finally:
            self._reading.pop()

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
        if node.domain in ("", "ai.onnx") and node.outputs and node.op_type in VECTOR_RULES:
            self.partial(node.outputs[0])

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
            return None if a is None else [[len(shape_slice(node, a))]]
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
            lengths = split_sizes(node, a[axis])
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


# Operand chains deeper than this are not followed (a shape computation is a handful of nodes).
_MAX_DEPTH = 48


class _Depth:
    """The evaluator as a rule sees it: operands evaluated one level deeper."""

    def __init__(self, shapes: SymbolicShapes, depth: int) -> None:
        self._shapes, self._depth = shapes, depth

    def partial(self, value: ir.Value | None) -> list[Dim | None] | None:
        return self._shapes.partial(value, self._depth)

    def dims(self, value: ir.Value | None) -> list[Dim] | None:
        return self._shapes.dims(value)
