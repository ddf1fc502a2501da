"""Row constants in the value lattice (passes/_lattice.py): a constant tensor broadcast over the leading axes.

A value is a *row* ``R`` when it equals ``broadcast(R, shape(value))`` with ``R.ndim <= rank(value)``:
what ``x @ 0 + b`` is (``b`` over every token). A uniform is the row of rank 0. This module holds
the transfers: given the rows of a node's inputs (uniforms as 0-d arrays, small constants as their
arrays, None = unknown), the rows of its outputs.

Cases:
1. Elementwise ops (unary, activations with attributes, binary, variadic, Where, Cast): numpy
   broadcasting of the rows is the broadcast of the values.
2. ``MatMul(row, W)``, ``Gemm(row, W, C)``: one row times the constant weight; ``Gemm(x, 0, C)`` is
   ``beta * C`` (NOTE: assumes x finite, like ``x * 0``).
3. Norms over trailing axes (``LayerNormalization``, ``SimplifiedLayerNormalization``,
   ``RMSNormalization``), ``Softmax``/``LogSoftmax`` and ``ReduceMean``/``Max``/``Min``: the
   statistics of identical rows are the row's.
4. Data movement that commutes with the broadcast once the row is promoted to the value's rank:
   Identity, Dropout (inference), Expand, Unsqueeze, Squeeze, Transpose, and Slice/Gather/Split
   (axes where the row has size 1 stay 1); Reshape/Flatten when a 1-D row stays the last axis.
5. ``Gather(table, positions)`` (or ``GatherND`` with ``[..., 1]`` indices) of a constant table whose
   rows along axis 0 are all equal (a cached ``[positions, sin | cos]`` table once the frequencies
   are zero) is that row.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._lattice import ELEMENTWISE_BINARY, UNARY, UNARY_ATTR

__all__ = ["MAX_ROW_ELEMENTS", "transfer_row"]

logger = logging.getLogger(__name__)

MAX_ROW_ELEMENTS = 1 << 20  # a row is materialised as an initializer: keep it small

Row = np.ndarray
RankOf = Callable[[ir.Value], int | None]
DimsOf = Callable[[ir.Value], list[int | str] | None]


def transfer_row(
    node: ir.Node, ins: list[Row | None], rank_of: RankOf, dims_of: DimsOf, *, assume_finite: bool
) -> list[Row | None]:
    """Rows of ``node``'s outputs given those of its inputs (None = unknown)."""
    outs: list[Row | None] = [None] * len(node.outputs)
    if node.domain not in ("", "ai.onnx") or not node.outputs:
        return outs
    try:
        with np.errstate(all="ignore"):
            results = _rule(node, ins, rank_of, dims_of, assume_finite)
    except (ValueError, IndexError, TypeError) as exc:  # shapes that do not broadcast: not a row
        logger.debug("row transfer of %s (%s) gave up: %s", node.name, node.op_type, exc)
        return outs
    if results is None:
        return outs
    for k, (out, row) in enumerate(zip(node.outputs, results)):
        rank = rank_of(out)
        if row is None or rank is None or np.ndim(row) > rank or np.size(row) > MAX_ROW_ELEMENTS:
            continue
        try:
            dtype = out.dtype.numpy() if out.dtype is not None else None
        except Exception:
            dtype = None
        if dtype is None or dtype.kind not in "biuf":
            continue
        outs[k] = np.asarray(row).astype(dtype)
    return outs


def _full(row: Row, rank: int) -> Row:
    """The row promoted to ``rank`` (leading ones): same broadcast, every axis addressable."""
    row = np.asarray(row)
    return row.reshape((1,) * (rank - row.ndim) + row.shape)


def _axes(node: ir.Node, k: int, rank: int | None) -> list[int] | None:
    """Constant axes of ``node`` (attribute or input ``k``), normalised to ``rank`` when given."""
    if "axes" in node.attributes:
        axes = list(node.attributes.get_ints("axes", []))
    elif k < len(node.inputs) and node.inputs[k] is not None:
        array = const_array(node.inputs[k])
        if array is None:
            return None
        axes = [int(x) for x in array.reshape(-1)]
    else:
        axes = []
    return axes if rank is None else [a % rank for a in axes]


def _rule(
    node: ir.Node, ins: list[Row | None], rank_of: RankOf, dims_of: DimsOf, assume_finite: bool
) -> list[Row | None] | None:
    op = node.op_type
    attrs = node.attributes
    x = ins[0] if ins else None
    rank = rank_of(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None

    # Case 1
    if op in UNARY and op != "CastLike":
        return None if x is None else [UNARY[op](x)]
    if op in ("Cast", "CastLike", "Identity"):
        return None if x is None else [x]
    if op in UNARY_ATTR:
        return None if x is None else [UNARY_ATTR[op](node, x)]
    if op in ELEMENTWISE_BINARY:
        if any(v is None for v in ins) or not ins:
            return None
        acc = ins[0]
        for other in ins[1:]:
            acc = ELEMENTWISE_BINARY[op](acc, other)
        return None if acc is None else [acc]
    if op == "Mean":
        return None if any(v is None for v in ins) else [np.mean(np.broadcast_arrays(*ins), axis=0)]
    if op == "Where":
        return None if any(v is None for v in ins) else [np.where(ins[0], ins[1], ins[2])]

    # Case 2
    if op == "MatMul":
        return _matmul(x, ins[1] if len(ins) > 1 else None)
    if op == "Gemm":
        return _gemm(node, ins, assume_finite)

    if op == "Gather" and x is not None and len(ins) > 1 and ins[1] is None:
        return _gather_from_table(node, x)
    if op == "GatherND" and x is not None and len(ins) > 1 and ins[1] is None and not attrs.get_int("batch_dims", 0):
        index_dims = dims_of(node.inputs[1])
        # indices [..., 1] pick whole slices along axis 0, as Gather(axis=0) does (the dynamo form)
        return _gather_from_table(node, x) if index_dims and index_dims[-1] == 1 else None
    if x is None or rank is None:
        return None
    full = _full(x, rank)

    # Case 3
    if op in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"):
        first = attrs.get_int("axis", -1) % rank
        axes = tuple(range(first, rank))
        eps = attrs.get_float("epsilon", 1e-5)
        values = full.astype(np.float64)
        if op == "LayerNormalization":
            values = values - values.mean(axis=axes, keepdims=True)
        normed = values / np.sqrt((values * values).mean(axis=axes, keepdims=True) + eps)
        scale = ins[1] if len(ins) > 1 else None
        if scale is None:
            return None
        normed = normed * scale
        if op == "LayerNormalization" and len(node.inputs) > 2 and node.inputs[2] is not None:
            if ins[2] is None:
                return None
            normed = normed + ins[2]
        return [normed]
    if op in ("Softmax", "LogSoftmax"):
        axis = attrs.get_int("axis", -1) % rank
        # NOTE: before opset 13 Softmax normalises over every axis from `axis` on: the last axis is
        # the one where both definitions agree.
        if axis != rank - 1 or full.shape[axis] == 1:
            return None  # the real size is not the row's: the uniform transfer knows static sizes
        shifted = full.astype(np.float64) - full.max(axis=axis, keepdims=True)
        log = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
        return [log if op == "LogSoftmax" else np.exp(log)]
    if op in ("ReduceMean", "ReduceMax", "ReduceMin"):
        axes = _axes(node, 1, rank)
        if axes is None or (not axes and attrs.get_int("noop_with_empty_axes", 0)):
            return None
        axes = axes or list(range(rank))
        reduce = {"ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min}[op]
        keep = bool(attrs.get_int("keepdims", 1))
        return [reduce(full, axis=tuple(axes), keepdims=keep)]

    # Case 4
    if op in ("Expand", "Dropout"):
        if op == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            mode = const_array(node.inputs[2])
            if mode is None or bool(mode):
                return None  # training mode drops at random
        return [x] + [None] * (len(node.outputs) - 1)
    if op == "Unsqueeze":
        raw = _axes(node, 1, None)
        if not raw:
            return None
        return [np.expand_dims(full, tuple(sorted(a % (rank + len(raw)) for a in raw)))]
    if op == "Squeeze":
        axes = _axes(node, 1, rank)
        if not axes:
            return None
        return [np.squeeze(full, axis=tuple(axes))]
    if op == "Transpose":
        perm = attrs.get_ints("perm", list(range(rank))[::-1])
        return [np.transpose(full, perm)]
    if op == "Slice":
        return _slice(node, full, rank)
    if op == "Gather":
        indices = const_array(node.inputs[1])
        if indices is None:
            return None
        axis = attrs.get_int("axis", 0) % rank
        if full.shape[axis] == 1:
            indices = np.zeros_like(indices)
        return [np.take(full, indices, axis=axis)]
    if op == "Split":
        return _split(node, full, rank)
    if op in ("Reshape", "Flatten"):
        row = np.asarray(x)
        if row.ndim > 1:
            return None
        in_dims, out_dims = dims_of(node.inputs[0]), dims_of(node.outputs[0])
        if not in_dims or not out_dims:
            return None
        width = 1 if row.ndim == 0 else row.shape[0]
        # A 1-D row is the last axis: it stays a row when that axis is kept whole.
        if row.ndim == 1 and not (in_dims[-1] == out_dims[-1] == width):
            return None
        return [row]
    return None


def _gather_from_table(node: ir.Node, table: Row) -> list[Row | None] | None:
    """Rows of a constant table, every one equal, gathered at run-time positions: the row itself.

    What a cached ``[positions, sin | cos]`` table (GPT-J) is once the frequencies are zero.
    """
    table = np.asarray(table)
    axis = node.attributes.get_int("axis", 0) if node.op_type == "Gather" else 0
    if table.ndim < 1 or axis % table.ndim != 0 or table.shape[0] == 0:
        return None
    if table.shape[0] > 1 and not np.array_equal(table[1], table[0]):  # a cheap refusal first
        return None
    if not np.all(table == table[0:1]):
        return None
    return [table[0]]


def _matmul(a: Row | None, w: Row | None) -> list[Row | None] | None:
    if a is None or w is None or np.ndim(w) != 2:
        return None
    k = w.shape[0]
    a = np.asarray(a)
    if a.ndim == 0:
        a = np.broadcast_to(a, (k,))
    elif a.shape[-1] == 1 and k != 1:
        a = np.broadcast_to(a, (*a.shape[:-1], k))
    return [a.astype(np.float64) @ w.astype(np.float64) if a.dtype.kind == "f" else a @ w]


def _gemm(node: ir.Node, ins: list[Row | None], assume_finite: bool) -> list[Row | None] | None:
    attrs = node.attributes
    alpha, beta = attrs.get_float("alpha", 1.0), attrs.get_float("beta", 1.0)
    a, b = ins[0], ins[1] if len(ins) > 1 else None
    has_c = len(node.inputs) > 2 and node.inputs[2] is not None
    c = ins[2] if has_c else np.zeros(())
    if c is None:
        return None
    zero_b = b is not None and np.ndim(b) == 0 and not bool(b)
    if assume_finite and zero_b:
        # Gemm(x, 0, C) -> beta * C  (NOTE: NaN/Inf in x; folded under assume_finite like x * 0)
        return [beta * np.asarray(c, dtype=np.float64)]
    if a is None or b is None or np.ndim(b) != 2 or attrs.get_int("transA", 0):
        return None
    a = np.asarray(a)
    if a.ndim == 2 and a.shape[0] != 1:
        return None
    a = a.reshape(-1)
    weight = b.T if attrs.get_int("transB", 0) else b
    if a.size == 1:
        a = np.broadcast_to(a, (weight.shape[0],))
    product = a.astype(np.float64) @ weight.astype(np.float64)
    return [alpha * product + beta * np.asarray(c, dtype=np.float64)]


def _slice(node: ir.Node, full: Row, rank: int) -> list[Row | None] | None:
    starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
    axes = _axes(node, 3, rank)
    steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or axes is None:
        return None
    axes = axes or list(range(len(starts)))
    steps_list = [1] * len(axes) if steps is None else [int(s) for s in steps.reshape(-1)]
    index: list[slice] = [slice(None)] * rank
    for axis, start, end, step in zip(axes, starts.reshape(-1), ends.reshape(-1), steps_list):
        if full.shape[axis] == 1:
            continue  # broadcast axis: every selected element is the same
        end = int(np.clip(end, -(2**62), 2**62))
        index[axis] = slice(int(start), end, step)
    return [full[tuple(index)]]


def _split(node: ir.Node, full: Row, rank: int) -> list[Row | None] | None:
    axis = node.attributes.get_int("axis", 0) % rank
    count = len(node.outputs)
    if full.shape[axis] == 1:
        return [full] * count
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_array(node.inputs[1])
        if sizes is None:
            return None
        sizes = [int(s) for s in sizes.reshape(-1)]
    elif "split" in node.attributes:
        sizes = list(node.attributes.get_ints("split", []))
    else:
        size = math.ceil(full.shape[axis] / count)
        sizes = [min(size, full.shape[axis] - i * size) for i in range(count)]
    bounds = np.cumsum([0, *sizes])
    if bounds[-1] != full.shape[axis]:
        return None
    return [np.take(full, np.arange(lo, hi), axis=axis) for lo, hi in itertools.pairwise(bounds)]
