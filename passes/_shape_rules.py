"""The rules of the one symbolic shape / integer-vector evaluator (``passes/_shapes.SymbolicShapes``).

Pure functions over dims (``Dim``: a static size, or the key of a class of equal run-time sizes) and the op table
of the integer-vector evaluator (``VECTOR_RULES``: op -> the contents of its output from its operands' contents),
so that every pass asks the same evaluator: ``SymbolicShapes`` (the value lattice, uniform propagation, zero
flags), ``SymbolicShapes().ints`` (structured zeros' bounds) and ``SymbolicShapes().static_vector`` (the MoE
matcher's shape arithmetic, with the nodes it read). No other module of ``passes/`` follows integer vectors
through ops (``tests/compiler/test_architecture.py`` checks it).

A vector here is ``list[Dim | None]``: ``None`` is an element not known at compile time (a rule never guesses
one); an unknown vector is ``None``. Rules beyond the ops' own definitions:
- ``reshape_wildcard``: a Reshape's ``-1`` is the operand's element count over the target's other dims
  (split heads ``[b, s, 64] -> [b, s, -1, 16]`` gives 4, merge heads gives 64 back);
- ``slice_length`` / ``split_lengths``: exact lengths of Slice / Split along a static axis, the whole axis
  for ``[0:INT_MAX]`` of a symbolic one; ``split_sizes`` reads a Split's sizes (input or attribute);
- vector contents through ``ConstantOfShape``, elementwise ``Add/Sub/Mul/Div/Equal/Max/Min``
  (``vector_elementwise``: a symbolic element is a size, so never negative), ``Where`` (``vector_where``):
  torch's ``expand(b, -1, s, s)`` becomes ``[b, 1, s, s]`` again; ``Shape``, ``Gather``, ``Slice``,
  ``Concat``, ``OneHot`` (TorchScript's ``repeat_interleave`` repeats) and the casts / reshapes that keep them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array

__all__ = [
    "SHAPE_VECTOR_MAX",
    "VECTOR_OPS",
    "VECTOR_RULES",
    "Dim",
    "reshape_wildcard",
    "shape_slice",
    "slice_length",
    "split_lengths",
    "split_sizes",
    "vector_elementwise",
    "vector_where",
]

Dim = int | str  # a static size, or the key of a union-find class of equal run-time sizes
Vector = list[Dim | None]  # contents of a small integer tensor; None: an element not known

SHAPE_VECTOR_MAX = 16  # integer tensors longer than this are not shape vectors
_VECTOR_DTYPES = (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL)
_BIG = 2**62  # a Slice's "to the end" (INT_MAX, INT64_MAX) clipped to what Python slices take


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


def split_sizes(node: ir.Node, dim: Dim) -> list[Dim | None]:
    """Lengths of a ``Split``'s outputs along an axis of size ``dim``: its sizes (the ``split`` input from
    opset 13, the attribute before), or ``dim`` cut into equal parts (``split_lengths``); ``None`` for each
    part whose length is not known (sizes computed at run time)."""
    parts = len(node.outputs)
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        return [None] * parts if array is None else split_lengths(dim, [int(x) for x in array.reshape(-1)], parts)
    if "split" in node.attributes:
        return split_lengths(dim, list(node.attributes.get_ints("split", [])), parts)
    return split_lengths(dim, None, parts)


def shape_slice(node: ir.Node, dims: list) -> list:
    """The dims a ``Shape`` node returns of ``dims`` (its ``start`` / ``end``, clamped)."""
    rank = len(dims)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = max(0, min(rank, end + rank if end < 0 else end))
    return dims[start:end]


def vector_elementwise(op: str, a: list[Dim], b: list[Dim]) -> list[Dim] | None:
    """Contents of ``op(a, b)`` for two shape vectors (1-element vectors broadcast); None when unknown.

    Symbolic elements are run-time sizes, so they are >= 0: ``Equal(s, -1)`` is 0 (false), ``Equal(s, s)``
    is 1, ``s * 1``, ``s + 0``, ``s - 0`` and ``s / 1`` are ``s``, ``s * 0`` is 0. Any element that cannot
    be stated that way makes the whole result unknown (an unknown element is never given a fresh size:
    it may be negative).
    """
    out = _elementwise(op, a, b)  # type: ignore[arg-type]
    return None if out is None or any(d is None for d in out) else out  # type: ignore[return-value]


def _elementwise(op: str, a: Vector, b: Vector) -> Vector | None:
    """``op(a, b)`` element by element (1-element vectors broadcast); an element not stated is None."""
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    n = max(len(a), len(b))
    a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
    return [None if x is None or y is None else _element(op, x, y) for x, y in zip(a, b)]


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


# ------------------------------------------------------------------------------------------ the op table


class Operands(Protocol):
    """What a vector rule asks of the evaluator: an operand's contents, a value's dims."""

    def partial(self, value: ir.Value | None) -> Vector | None: ...

    def dims(self, value: ir.Value | None) -> list[Dim] | None: ...


def _operand(node: ir.Node, k: int) -> ir.Value | None:
    return node.inputs[k] if k < len(node.inputs) else None


def _known_ints(vector: Vector | None) -> list[int] | None:
    """A vector whose every element is a static int (indices, bounds), else None."""
    if vector is None or not all(isinstance(d, int) for d in vector):
        return None
    return vector  # type: ignore[return-value]


def _shape(node: ir.Node, ev: Operands) -> Vector | None:  # Shape(x) -> dims of x
    dims = ev.dims(_operand(node, 0))
    return None if dims is None else shape_slice(node, dims)


def _kept(node: ir.Node, ev: Operands) -> Vector | None:  # Cast / Identity / (Un)Squeeze / Reshape(v) -> v
    out = node.outputs[0]
    if out.dtype is not None and out.dtype not in _VECTOR_DTYPES:
        return None  # a float (or narrow) cast: no integer vector
    result = ev.partial(_operand(node, 0))
    if result is not None and out.dtype == ir.DataType.BOOL:  # Cast to bool: nonzero -> 1
        result = [int(d != 0) for d in result] if all(isinstance(d, int) for d in result) else None
    if result is not None and node.op_type in ("Reshape", "Unsqueeze", "Squeeze"):
        # The contents keep their order; a result of rank > 1 is no vector. A Reshape of unknown rank keeps a
        # 1-element vector only (a scalar <-> [1]).
        dims = ev.dims(out)
        if (dims is not None and len(dims) > 1) or (dims is None and node.op_type == "Reshape" and len(result) != 1):
            return None
    return result


def _constant_of_shape(node: ir.Node, ev: Operands) -> Vector | None:  # ConstantOfShape([n], v) -> [v] * n
    target = ev.partial(_operand(node, 0))
    attr = node.attributes.get("value")
    fill = attr.as_tensor().numpy() if attr is not None else np.zeros(1, np.float32)
    if target is not None and len(target) == 1 and isinstance(target[0], int) and fill.dtype.kind in "iub":
        return [int(fill.reshape(-1)[0])] * target[0]
    return None


def _binary(node: ir.Node, ev: Operands) -> Vector | None:  # Add / Sub / Mul / Div / Equal / Max / Min
    if len(node.inputs) != 2:
        return None
    a, b = ev.partial(node.inputs[0]), ev.partial(node.inputs[1])
    return None if a is None or b is None else _elementwise(node.op_type, a, b)


def _where(node: ir.Node, ev: Operands) -> Vector | None:  # Where(c, x, y) -> x where c else y
    cond, x, y = (ev.partial(_operand(node, k)) for k in range(3))
    if cond is None or x is None or y is None or any(c is None for c in cond):
        return None
    return vector_where(cond, x, y)  # type: ignore[arg-type]


def _gather(node: ir.Node, ev: Operands) -> Vector | None:  # Gather(v, i) -> v[i] (axis 0 of a vector)
    data, index = ev.partial(_operand(node, 0)), _known_ints(ev.partial(_operand(node, 1)))
    if data is None or index is None or node.attributes.get_int("axis", 0) not in (0, -1):
        return None
    if any(not -len(data) <= i < len(data) for i in index):
        return None
    return [data[i] for i in index]


def _slice(node: ir.Node, ev: Operands) -> Vector | None:  # Slice(v, [b], [e], [0], [s]) -> v[b:e:s]
    data = ev.partial(_operand(node, 0))
    starts, ends = _known_ints(ev.partial(_operand(node, 1))), _known_ints(ev.partial(_operand(node, 2)))
    axes = [0] if _operand(node, 3) is None else _known_ints(ev.partial(_operand(node, 3)))
    steps = [1] if _operand(node, 4) is None else _known_ints(ev.partial(_operand(node, 4)))
    if data is None or starts is None or ends is None or axes is None or steps is None:
        return None
    if len(starts) != 1 or len(ends) != 1 or axes not in ([0], [-1]) or len(steps) != 1 or steps[0] == 0:
        return None
    return data[starts[0] : int(np.clip(ends[0], -_BIG, _BIG)) : steps[0]]


def _concat(node: ir.Node, ev: Operands) -> Vector | None:  # Concat(a, b, ...) -> a + b + ...
    parts = [ev.partial(v) for v in node.inputs]
    return None if any(p is None for p in parts) else [d for p in parts for d in p]  # type: ignore[union-attr]


def _one_hot(node: ir.Node, ev: Operands) -> Vector | None:  # OneHot([i], d, [off, on]) -> the flat rows
    # TorchScript's repeat_interleave builds its repeats [1, k, 1] as OneHot([1], 3, [1, k]).
    indices = _known_ints(ev.partial(_operand(node, 0)))
    depth, values = _known_ints(ev.partial(_operand(node, 1))), ev.partial(_operand(node, 2))
    if indices is None or depth is None or values is None or len(depth) != 1 or len(values) != 2:
        return None
    if node.attributes.get_int("axis", -1) != -1 or depth[0] <= 0:
        return None
    (d,), (off, on) = depth, values
    return [on if -d <= i < d and j == i % d else off for i in indices for j in range(d)]


# op -> the contents of its output 0 from its operands' (rules as data: one row an op).
VECTOR_RULES: dict[str, Callable[[ir.Node, Operands], Vector | None]] = {
    "Shape": _shape,  # Shape(x)[start:end] -> x's dims
    "Cast": _kept,  # Cast(v) -> v (to an integer type; to bool: nonzero -> 1)
    "Identity": _kept,  # Identity(v) -> v
    "Squeeze": _kept,  # Squeeze(v) -> v (a 1-D or 0-D result)
    "Unsqueeze": _kept,  # Unsqueeze(v) -> v (a 1-D result)
    "Reshape": _kept,  # Reshape(v, shape) -> v (a 1-D result)
    "ConstantOfShape": _constant_of_shape,  # ConstantOfShape([n], value=c) -> [c] * n
    "Add": _binary,  # [a] + [b] -> [a + b], s + 0 -> s
    "Sub": _binary,  # [a] - [b] -> [a - b], s - 0 -> s, s - s -> 0
    "Mul": _binary,  # [a] * [b] -> [a * b], s * 1 -> s, s * 0 -> 0
    "Div": _binary,  # [a] / [b] -> [a // b] (both >= 0), s / 1 -> s
    "Equal": _binary,  # [a] == [b] -> [0 | 1], s == -1 -> 0
    "Max": _binary,  # max(a, b) of static elements
    "Min": _binary,  # min(a, b) of static elements
    "Where": _where,  # Where(c, x, y) -> x[i] if c[i] else y[i]
    "Gather": _gather,  # Gather(v, i) -> v[i]
    "Slice": _slice,  # Slice(v, b, e, 0, s) -> v[b:e:s]
    "Concat": _concat,  # Concat(a, b) -> a + b
    "OneHot": _one_hot,  # OneHot(i, d, [off, on]) -> [on if j == i else off for j < d] for each i
}
VECTOR_OPS = frozenset(VECTOR_RULES)  # the ops the evaluator follows an integer vector through
