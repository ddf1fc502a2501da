"""Structured zeros: the rows, columns and blocks of weights that pruning tools leave zero (issue 8, item 3).

A weight that is zero only in some rows or columns is kept whole by the value lattice (it is no uniform). This pass
slices such weights so the MatMuls shrink, working from the operands: the contraction axis of ``MatMul`` / ``Gemm``,
``Split`` / ``Slice`` of fused weights, and the elementwise ops between them.

Cases:
1. Pruned neurons. ``MatMul(A, W)`` / ``Gemm(A, W, C)`` with a constant weight: entry ``k`` of ``A``'s last axis is
   *dead* when row ``k`` of ``W`` is zero, or when column ``k`` of ``A`` is a known constant ``c_k`` (its producing
   columns are zero, so ``act(b_k) * ...`` is known). The chain that computes ``A`` (linear leaves ``x @ W_p (+ b)``,
   elementwise ops and activations, constants along the last axis, Reshapes that keep the last axis) is sliced
   along that axis to the live entries, and ``sum_k c_k * W[k]`` (a row) goes into the consumer's bias.
   # act(x @ Wg) * (x @ Wu) @ Wd  ->  act(x @ Wg[:, live]) * (x @ Wu[:, live]) @ Wd[live]
2. Zero blocks of fused weights. A leaf of Case 1 may be a piece of a fused projection (Phi-3's ``gate_up_proj``):
   ``Split`` or ``Slice`` (constant or ``Shape``-computed bounds, ``chunk``'s form) of ``x @ W`` along its last axis.
   The fused weight keeps the live columns of each piece, the split sizes / slice bounds follow. When every entry
   is dead (an up or gate half all zero), the consumer's weight becomes one zero row: the lattice folds the MLP.
3. Zero output columns whose consumer cannot be narrowed (a pruned attention head's query rows): ``x @ W (+ b)``
   whose leading and/or trailing columns of ``W`` (and ``b``) are zero becomes ``Pad(x @ W[:, live] (+ b[live]))``
   with zeros: the MatMul shrinks, the value is the same.
   # x @ W + b  ->  Pad(x @ W[:, a:b] + b[a:b], zeros)
   Interior zero columns (head 2 of 4): the narrower MatMul gets one zero column appended and a ``Gather`` puts
   every column back in place.
4. Zero contraction rows whose producer cannot be narrowed (a pruned head's columns of the output projection):
   ``A @ W`` whose leading and/or trailing rows of ``W`` are zero becomes ``Slice(A)[..., a:b] @ W[a:b]``;
   interior ones ``Gather(A, live, axis=-1) @ W[live]``.
Cases 3 and 4 add a node: only for weights of 16 or more on both axes losing at least 1/64 of an axis.

Every rewrite assumes finite activations (``NaN * 0``), like the lattice's ``x * 0``: the pass runs only under
``assume_finite`` and verification guards it. A chain is narrowed only when each value whose width changes is read
by the chain alone (``Shape`` readers only where their size reaches no other node). A weight that is all zero is
left to the lattice; a weight read by several nodes (tied embeddings) is not narrowed (it would be duplicated).
``removed_params`` counts the weight and bias elements removed (model metadata
``layerzero.structured_zeros.params_removed`` accumulates it for the compile summary).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import NameFactory, const_array, make_constant, rename_output
from layerzero.passes._lattice import ELEMENTWISE_BINARY, UNARY, UNARY_ATTR
from layerzero.passes._scope import Scopes

__all__ = ["PARAMS_REMOVED_KEY", "RemoveStructuredZeros"]

logger = logging.getLogger(__name__)

PARAMS_REMOVED_KEY = "layerzero.structured_zeros.params_removed"
_MAX_CHAIN = 48  # values in one chain: an MLP has a handful; more is a residual stream walked back
_MAX_WEIGHT_READ = 1 << 28  # elements: bigger weights are not read for structure
_MIN_WIDTH = 16  # Cases 3 / 4: narrower axes are not worth a node
_STD = ("", "ai.onnx")
# Binary ops of Case 1 that act per element (broadcast operands keep their columns).
_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum"})
# Int ops the bound evaluator follows (chunk's Slice bounds from Shape).
_INT_OPS = frozenset({"Gather", "Add", "Sub", "Mul", "Div", "Cast", "Unsqueeze", "Squeeze", "Concat", "Identity",
                      "Slice", "Reshape", "Shape", "Constant"})  # fmt: skip


class _Refuse(Exception):
    """A chain that cannot be narrowed (the message says why; logged at debug level)."""


def _std(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in _STD and node.op_type in ops


def _label(node: ir.Node) -> str:
    """The node's name, else its first output's (text models have unnamed nodes)."""
    return node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else node.op_type)


def _static_dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _last_dim(value: ir.Value | None) -> int | None:
    dims = _static_dims(value)
    return dims[-1] if dims else None


def _weight(value: ir.Value | None, *, own: bool = False) -> np.ndarray | None:
    """A constant 2-D float weight small enough to read (an initializer that is no graph input).

    ``own``: read by one node only. A shared weight (tied embeddings and LM head) would be duplicated by
    narrowing it for one reader, not removed.
    """
    if value is None or (own and len({user for user, _ in value.uses()}) != 1):
        return None
    tensor = value.const_value
    if tensor is not None and tensor.size > _MAX_WEIGHT_READ:
        return None
    array = const_array(value)
    if array is None or array.ndim != 2 or array.dtype.kind != "f" or array.size == 0:
        return None
    return array


_LINES_META_KEY = "layerzero.zero_lines"


def _zero_lines(value: ir.Value, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zero rows, zero columns) of a constant 2-D weight, cached on the value.

    A zero row starts with a zero and a zero column is zero in row 0: only those candidates are read whole, so
    a dense weight costs one row and one column (memory-mapped pages stay cold), and the fixpoint's later
    iterations read nothing.
    """
    cached = value.meta.get(_LINES_META_KEY)
    if cached is not None and cached[0].shape[0] == array.shape[0] and cached[1].shape[0] == array.shape[1]:
        return cached
    rows = np.zeros(array.shape[0], bool)
    cols = np.zeros(array.shape[1], bool)
    for k in np.flatnonzero(array[:, 0] == 0):
        rows[k] = not np.any(array[k])
    candidates = np.flatnonzero(array[0] == 0)
    for start in range(0, candidates.size, 256):  # a bounded temporary per block of columns
        block = candidates[start : start + 256]
        cols[block] = ~np.any(array[:, block] != 0, axis=0)
    value.meta[_LINES_META_KEY] = (rows, cols)
    return rows, cols


@dataclasses.dataclass
class _Matrix:
    """A constant weight in its math form ``[in, out]``: the stored array (``transposed`` for Gemm's
    ``transB``) times ``alpha``, read lazily."""

    value: ir.Value
    array: np.ndarray
    transposed: bool = False
    alpha: float = 1.0

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.array.shape
        return (cols, rows) if self.transposed else (rows, cols)

    def zero_rows(self) -> np.ndarray:
        lines = _zero_lines(self.value, self.array)
        return lines[1] if self.transposed else lines[0]

    def zero_cols(self) -> np.ndarray:
        lines = _zero_lines(self.value, self.array)
        return lines[0] if self.transposed else lines[1]

    def rows(self, index: np.ndarray) -> np.ndarray:
        picked = self.array[:, index].T if self.transposed else self.array[index]
        return self.alpha * picked.astype(np.float64)


def _set_last_dim(value: ir.Value, size: int) -> None:
    if value.shape is not None and len(value.shape) > 0:
        dims = list(value.shape)
        dims[-1] = size
        value.shape = ir.Shape(dims)


# ------------------------------------------------------------------------------------------------ linear leaves


@dataclasses.dataclass
class _Linear:
    """``out = x @ W (+ bias)`` along its last axis: a MatMul or Gemm with a constant weight, maybe an Add of a
    constant bias. ``weight`` is the math form ``[in, N]`` (Gemm's ``alpha`` and ``transB`` applied)."""

    node: ir.Node
    weight: _Matrix
    bias: np.ndarray | None  # [N], what the output column equals when the weight column is zero
    add: ir.Node | None  # a separate bias Add (its constant operand's index in ``add_index``)
    add_index: int
    out: ir.Value

    @property
    def width(self) -> int:
        return self.weight.shape[1]

    def zero_columns(self) -> np.ndarray:
        return self.weight.zero_cols()

    def column_values(self) -> np.ndarray:
        return np.zeros(self.width) if self.bias is None else self.bias.astype(np.float64)

    def internal(self) -> list[ir.Value]:
        """Values of the leaf whose width changes besides ``out``."""
        return [self.node.outputs[0]] if self.add is not None else []

    def nodes(self) -> list[ir.Node]:
        return [self.node] + ([self.add] if self.add is not None else [])


def _bias_vector(array: np.ndarray, width: int) -> np.ndarray | None:
    """A constant that broadcasts as a bias along the last axis of width ``width``, as a [width] vector."""
    if array.size == 1:
        return np.full(width, array.reshape(-1)[0], dtype=np.float64)
    if array.ndim >= 1 and array.shape[-1] == width and array.size == width:
        return array.reshape(-1).astype(np.float64)
    return None


def _linear(value: ir.Value) -> _Linear | None:
    """The linear leaf computing ``value``, or None."""
    node = value.producer()
    if node is None or len(node.outputs) != 1:
        return None
    if _std(node, "Add") and len(node.inputs) == 2:
        for k in (0, 1):  # both operand orders
            inner, bias_value = node.inputs[k], node.inputs[1 - k]
            if inner is None or bias_value is None or len(inner.uses()) != 1 or inner.is_graph_output():
                continue
            base = _linear_node(inner)
            bias = const_array(bias_value)
            if base is None or base.bias is not None or bias is None:
                continue
            vector = _bias_vector(bias, base.width)
            if vector is None:
                continue
            return dataclasses.replace(base, bias=vector, add=node, add_index=1 - k, out=value)
        return None
    return _linear_node(value)


def _linear_node(value: ir.Value) -> _Linear | None:
    node = value.producer()
    if _std(node, "MatMul") and len(node.inputs) == 2:
        weight = _weight(node.inputs[1], own=True)
        x = node.inputs[0]
        if weight is None or x is None or x.shape is None or len(x.shape) < 1:
            return None
        return _Linear(node, _Matrix(node.inputs[1], weight), None, None, 0, value)
    if _std(node, "Gemm") and not node.attributes.get_int("transA", 0):
        raw = _weight(node.inputs[1], own=True)
        if raw is None:
            return None
        weight = _Matrix(node.inputs[1], raw, bool(node.attributes.get_int("transB", 0)))
        alpha, beta = node.attributes.get_float("alpha", 1.0), node.attributes.get_float("beta", 1.0)
        bias = None
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = const_array(node.inputs[2])
            if c is None:
                return None
            bias = _bias_vector(c, weight.shape[1])
            if bias is None:
                return None
            bias = beta * bias
        weight.alpha = alpha
        return _Linear(node, weight, bias, None, 0, value)
    return None


# ------------------------------------------------------------------------------------------------ int evaluation


def _int_vector(value: ir.Value | None, depth: int = 0) -> list[int | None] | None:
    """Contents of a small int tensor computed from constants and static dims (None entries: unknown sizes)."""
    if value is None or depth > 24:
        return None
    array = const_array(value)
    if array is not None:
        return [int(x) for x in array.reshape(-1)] if array.dtype.kind in "iu" and array.size <= 16 else None
    node = value.producer()
    if node is None or node.domain not in _STD or node.op_type not in _INT_OPS:
        return None
    op = node.op_type
    if op == "Shape":
        dims = _static_dims(node.inputs[0])
        if dims is None:
            return None
        rank = len(dims)
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)
        return dims[slice(start + rank if start < 0 else start, end + rank if end < 0 else end)]
    ins = [_int_vector(v, depth + 1) if v is not None else None for v in node.inputs[:1]]
    data = ins[0]
    if data is None:
        return None
    if op in ("Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape"):
        return data
    if op == "Gather":
        index = const_array(node.inputs[1])
        if index is None or index.ndim > 1:
            return None
        return [data[int(i)] for i in index.reshape(-1)]
    if op == "Slice":
        starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
        if starts is None or ends is None or starts.size != 1:
            return None
        end = int(np.clip(ends.reshape(-1)[0], -(2**62), 2**62))
        return data[int(starts.reshape(-1)[0]) : end]
    if op == "Concat":
        parts = [_int_vector(v, depth + 1) for v in node.inputs]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]  # type: ignore[union-attr]
    other = _int_vector(node.inputs[1], depth + 1)
    if other is None or (len(other) != len(data) and 1 not in (len(other), len(data))):
        return None
    n = max(len(other), len(data))
    a, b = data * n if len(data) == 1 else data, other * n if len(other) == 1 else other
    out: list[int | None] = []
    for x, y in zip(a, b):
        if x is None or y is None:
            out.append(None)
        elif op == "Add":
            out.append(x + y)
        elif op == "Sub":
            out.append(x - y)
        elif op == "Mul":
            out.append(x * y)
        else:
            out.append(int(x / y) if y else None)  # ONNX integer Div truncates
    return out


# ------------------------------------------------------------------------------------------------ Case 1 / 2 chains


@dataclasses.dataclass
class _Piece:
    """One piece (Split output or Slice) of a fused linear leaf along its last axis."""

    node: ir.Node  # the Split or Slice
    output: int  # which output of a Split
    offset: int
    width: int


@dataclasses.dataclass
class _Source:
    linear: _Linear
    pieces: list[_Piece]  # the Split's pieces in output order (Split), or the Slices reading the source
    in_chain: set[int]  # indices into pieces that belong to the chain


class _Chain:
    """The values computing a consumer's input ``A`` along its last axis (width ``K``), and how to narrow them."""

    def __init__(self, width: int, assume_finite: bool) -> None:
        self.width = width
        self.assume_finite = assume_finite
        self.values: dict[ir.Value, tuple[np.ndarray, np.ndarray]] = {}  # value -> (known, column values)
        self.nodes: set[ir.Node] = set()
        self.leaves: list[_Linear] = []
        self.sources: dict[ir.Value, _Source] = {}
        self.constants: list[tuple[ir.Node, int]] = []  # (node, input index) of a constant with the K axis
        self.reshapes: list[ir.Node] = []

    # the analysis ------------------------------------------------------------------------------------------
    def visit(self, value: ir.Value) -> tuple[np.ndarray, np.ndarray]:
        if value in self.values:
            return self.values[value]
        if len(self.values) >= _MAX_CHAIN:
            raise _Refuse(f"{value.name}: more than {_MAX_CHAIN} values in the chain (a residual stream)")
        # An unknown last size (chunk's Slices leave shape inference without one) is proved by the producer.
        if value.is_graph_output() or value.is_graph_input() or _last_dim(value) not in (None, self.width):
            raise _Refuse(f"{value.name}: not a width-{self.width} intermediate")
        node = value.producer()
        if node is None or node.domain not in _STD or len(node.outputs) < 1:
            raise _Refuse(f"{value.name}: no standard producer")
        result = self._visit_node(node, value)
        self.values[value] = result
        return result

    def _unknown(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.width, bool), np.zeros(self.width)

    def _visit_node(self, node: ir.Node, value: ir.Value) -> tuple[np.ndarray, np.ndarray]:
        op = node.op_type
        leaf = _linear(value)
        if leaf is not None:  # Case 1: a linear leaf
            self.leaves.append(leaf)
            self.nodes.update(leaf.nodes())
            return leaf.zero_columns(), leaf.column_values()
        if op in ("Split", "Slice"):  # Case 2
            return self._piece(node, value)
        self.nodes.add(node)
        if op in ("Identity", "Cast") or op in UNARY or op in UNARY_ATTR:
            known, vals = self.visit(node.inputs[0])
            if op in ("Identity", "Cast"):
                return known, vals
            with np.errstate(all="ignore"):
                out = UNARY[op](vals) if op in UNARY else UNARY_ATTR[op](node, vals)
            out = np.asarray(out, dtype=np.float64)
            return known & np.isfinite(out), np.where(known, out, 0.0)
        if op == "Reshape":
            in_dims, out_dims = _static_dims(node.inputs[0]), _static_dims(value)
            if not in_dims or not out_dims or in_dims[-1] not in (None, self.width):
                raise _Refuse(f"{node.name}: a Reshape that does not keep the last axis")
            shape = _int_vector(node.inputs[1])
            if shape is None or shape[-1] != self.width:
                raise _Refuse(f"{node.name}: the Reshape's last size is not provably {self.width}")
            self.reshapes.append(node)
            return self.visit(node.inputs[0])
        if op in _BINARY and op in ELEMENTWISE_BINARY and len(node.inputs) >= 2:
            return self._binary(node)
        raise _Refuse(f"{node.name}: {op} is not narrowed along the last axis")

    def _binary(self, node: ir.Node) -> tuple[np.ndarray, np.ndarray]:
        states: list[tuple[np.ndarray, np.ndarray]] = []
        for k, operand in enumerate(node.inputs):
            if operand is None:
                raise _Refuse(f"{node.name}: missing operand")
            array = const_array(operand)
            if array is not None:
                if array.ndim >= 1 and array.shape[-1] == self.width and self.width != 1:
                    self.constants.append((node, k))
                    vector = _bias_vector(array, self.width)
                    if vector is None:
                        states.append(self._unknown())
                    else:
                        states.append((np.ones(self.width, bool), vector))
                elif array.ndim == 0 or array.shape[-1] == 1:
                    if array.size == 1:
                        states.append((np.ones(self.width, bool), np.full(self.width, float(array.reshape(-1)[0]))))
                    else:
                        states.append(self._unknown())
                else:
                    raise _Refuse(f"{node.name}: a constant operand that does not broadcast along the last axis")
                continue
            last = _last_dim(operand)
            if last == 1 or (operand.shape is not None and len(operand.shape) == 0):
                states.append(self._unknown())  # broadcast along the last axis: untouched
            elif last in (None, self.width) and operand.shape is not None:
                states.append(self.visit(operand))
            else:
                raise _Refuse(f"{node.name}: operand {operand.name} is not provably broadcast along the last axis")
        known, vals = states[0]
        fn = ELEMENTWISE_BINARY[node.op_type]
        for other_known, other_vals in states[1:]:
            with np.errstate(all="ignore"):
                combined = np.asarray(fn(vals, other_vals), dtype=np.float64)
            both = known & other_known
            if node.op_type == "Mul" and self.assume_finite:
                # x * 0 -> 0 (NOTE: NaN/Inf in x; folded under assume_finite like the lattice)
                zero = (known & (vals == 0)) | (other_known & (other_vals == 0))
                combined = np.where(zero, 0.0, combined)
                both = both | zero
            both = both & np.isfinite(combined)
            known, vals = both, np.where(both, combined, 0.0)
        return known, vals

    def _piece(self, node: ir.Node, value: ir.Value) -> tuple[np.ndarray, np.ndarray]:
        source_value = node.inputs[0]
        if source_value is None:
            raise _Refuse(f"{node.name}: no data input")
        rank = len(source_value.shape) if source_value.shape is not None else None
        if rank is None:
            raise _Refuse(f"{node.name}: source rank unknown")
        source = self.sources.get(source_value)
        if source is None:
            leaf = _linear(source_value)
            if leaf is None:
                raise _Refuse(f"{node.name}: {node.op_type} of a value that is no linear leaf")
            source = _Source(leaf, _pieces(source_value, rank, leaf.width), set())
            self.sources[source_value] = source
            self.nodes.update(leaf.nodes())
        for i, piece in enumerate(source.pieces):
            if piece.node is node and node.outputs[piece.output] is value:
                if piece.width != self.width:
                    raise _Refuse(f"{node.name}: piece of width {piece.width}, chain width {self.width}")
                source.in_chain.add(i)
                self.nodes.add(node)
                lo, hi = piece.offset, piece.offset + piece.width
                return source.linear.zero_columns()[lo:hi], source.linear.column_values()[lo:hi]
        raise _Refuse(f"{node.name}: not a piece of {source_value.name}")

    def exclusive(self, consumer: ir.Node) -> None:
        """Every value whose width changes is read only by the chain (and the consumer)."""
        readers = self.nodes | {consumer}
        changed: list[ir.Value] = list(self.values)
        for leaf in self.leaves:
            changed += leaf.internal()
        for source in self.sources.values():
            changed += [source.linear.out, *source.linear.internal()]
            users = {user for user, _ in source.linear.out.uses()}
            if any(p.node not in users for p in source.pieces):
                raise _Refuse(f"{source.linear.out.name}: its pieces changed while reading")
        for value in changed:
            if value.is_graph_output():
                raise _Refuse(f"{value.name} is a graph output")
            for user, _index in value.uses():
                if user in readers:
                    continue
                if _std(user, "Shape") and self._shape_is_harmless(user):
                    continue
                raise _Refuse(f"{value.name} is also read by {_label(user)} ({user.op_type})")

    def _shape_is_harmless(self, shape: ir.Node) -> bool:
        """``Shape`` of a narrowed value whose last size reaches only inputs this rewrite replaces."""
        rank = len(shape.inputs[0].shape) if shape.inputs[0] is not None and shape.inputs[0].shape else None
        if rank is None:
            return False
        start, end = shape.attributes.get_int("start", 0), shape.attributes.get_int("end", rank)
        start, end = start + rank if start < 0 else start, end + rank if end < 0 else end
        if not start <= rank - 1 < end:
            return True  # the last axis is not read
        replaced = {(n, k) for n in self.reshapes for k in (1,)}
        for source in self.sources.values():
            replaced |= {(p.node, k) for p in source.pieces if p.node.op_type == "Slice" for k in (1, 2, 3, 4)}
        # positions of the last size in each int value downstream; None: it may be anywhere
        frontier: list[tuple[ir.Value, set[int] | None]] = [(shape.outputs[0], {rank - 1 - start})]
        seen: set[ir.Value] = set()
        while frontier:
            value, positions = frontier.pop()
            if value in seen:
                continue
            seen.add(value)
            for user, index in value.uses():
                if (user, index) in replaced:
                    continue
                if user.domain not in _STD or user.op_type not in _INT_OPS or value.is_graph_output():
                    return False
                if user.op_type == "Gather" and positions is not None and index == 0:
                    picked = const_array(user.inputs[1])
                    length = end - start
                    if picked is not None and not ({int(i) % length for i in picked.reshape(-1)} & positions):
                        continue  # only other axes' sizes are read
                frontier.append((user.outputs[0], None))
            if value.is_graph_output():
                return False
        return True

    # the rewrite --------------------------------------------------------------------------------------------
    def narrow(self, keep: np.ndarray, rewriter: _Rewriter) -> int:
        """Narrow the chain to the columns ``keep``; parameters removed."""
        removed = 0
        for leaf in self.leaves:
            removed += rewriter.narrow_linear(leaf, keep)
        for source in self.sources.values():
            columns: list[np.ndarray] = []
            new_offset = 0
            bounds: list[tuple[int, int]] = []
            for i, piece in enumerate(source.pieces):
                kept = keep if i in source.in_chain else np.arange(piece.width)
                columns.append(piece.offset + kept)
                bounds.append((new_offset, new_offset + len(kept)))
                new_offset += len(kept)
            removed += rewriter.narrow_linear(source.linear, np.concatenate(columns))
            rewriter.rewrite_pieces(source, bounds)
        for node, k in self.constants:
            array = const_array(node.inputs[k])
            assert array is not None
            narrowed = np.take(array, keep, axis=-1)
            node.replace_input_with(k, rewriter.constant(node.inputs[k].name or "lz_const", narrowed))
        for node in self.reshapes:
            rewriter.reshape_last(node, len(keep))
        for value in self.values:
            _set_last_dim(value, len(keep))
        return removed


def _pieces(source: ir.Value, rank: int, width: int) -> list[_Piece]:
    """The Split or Slices reading ``source`` along its last axis, as pieces; refuses anything else."""
    pieces: list[_Piece] = []
    for user, index in source.uses():
        if index != 0:
            raise _Refuse(f"{source.name}: read as a non-data input by {user.name}")
        if _std(user, "Split"):
            if user.attributes.get_int("axis", 0) % rank != rank - 1:
                raise _Refuse(f"{user.name}: Split not along the last axis")
            sizes = _split_sizes(user, width)
            offset = 0
            for i, size in enumerate(sizes):
                pieces.append(_Piece(user, i, offset, size))
                offset += size
        elif _std(user, "Slice"):
            starts, ends = _int_vector(user.inputs[1]), _int_vector(user.inputs[2])
            axes = _int_vector(user.inputs[3]) if len(user.inputs) > 3 and user.inputs[3] is not None else [0]
            steps = _int_vector(user.inputs[4]) if len(user.inputs) > 4 and user.inputs[4] is not None else [1]
            if None in (starts, ends, axes, steps) or len(starts) != 1 or len(axes) != 1:  # type: ignore[arg-type]
                raise _Refuse(f"{user.name}: Slice bounds not provably constant along one axis")
            if None in starts + ends + axes + steps or axes[0] % rank != rank - 1 or steps[0] != 1:  # type: ignore[operator]
                raise _Refuse(f"{user.name}: Slice not a step-1 range of the last axis")
            lo, hi, _ = slice(starts[0], ends[0]).indices(width)  # type: ignore[index]
            if hi <= lo:
                raise _Refuse(f"{user.name}: empty slice")
            pieces.append(_Piece(user, 0, lo, hi - lo))
        elif _std(user, "Shape"):
            continue  # chunk's bound computation: checked by the Slices' evaluation, replaced by constants
        else:
            raise _Refuse(f"{source.name}: read by {user.name} ({user.op_type})")
    splits = {p.node for p in pieces if p.node.op_type == "Split"}
    if splits and len({p.node for p in pieces}) > 1:
        # The narrowed source is the pieces laid end to end: a Split must be its only reader to partition it.
        raise _Refuse(f"{source.name}: a Split next to other readers")
    return pieces


def _split_sizes(node: ir.Node, width: int) -> list[int]:
    count = len(node.outputs)
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_array(node.inputs[1])
        if sizes is None:
            raise _Refuse(f"{node.name}: run-time split sizes")
        return [int(s) for s in sizes.reshape(-1)]
    if "split" in node.attributes:
        return list(node.attributes.get_ints("split", []))
    size = -(-width // count)
    return [min(size, width - i * size) for i in range(count)]


# ------------------------------------------------------------------------------------------------ rewriting


class _Rewriter:
    """Builds the narrowed weights and the few new nodes."""

    def __init__(self, root: ir.Graph, names: NameFactory) -> None:
        self.root = root
        self.names = names
        self.scopes = Scopes(root)

    def constant(self, hint: str, array: np.ndarray) -> ir.Value:
        return make_constant(self.root, self.names, f"{hint}_lz_narrowed", np.ascontiguousarray(array))

    def narrow_linear(self, leaf: _Linear, columns: np.ndarray) -> int:
        """Keep ``columns`` of the leaf's output; parameters removed."""
        node = leaf.node
        removed = 0
        raw = const_array(node.inputs[1])
        assert raw is not None
        axis = 0 if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) else 1
        new = np.take(raw, columns, axis=axis)
        removed += raw.size - new.size
        node.replace_input_with(1, self.constant(node.inputs[1].name or "lz_weight", new))
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            c = const_array(node.inputs[2])
            assert c is not None
            if c.size > 1:
                narrowed = np.take(c, columns, axis=-1)
                removed += c.size - narrowed.size
                node.replace_input_with(2, self.constant(node.inputs[2].name or "lz_bias", narrowed))
        _set_last_dim(node.outputs[0], len(columns))
        if leaf.add is not None:
            operand = leaf.add.inputs[leaf.add_index]
            bias = const_array(operand)
            assert bias is not None
            if bias.size > 1:
                narrowed = np.take(bias, columns, axis=-1)
                removed += bias.size - narrowed.size
                leaf.add.replace_input_with(leaf.add_index, self.constant(operand.name or "lz_bias", narrowed))
            _set_last_dim(leaf.add.outputs[0], len(columns))
        return removed

    def rewrite_pieces(self, source: _Source, bounds: list[tuple[int, int]]) -> None:
        done: set[ir.Node] = set()
        for piece, (lo, hi) in zip(source.pieces, bounds):
            node = piece.node
            if node.op_type == "Slice":
                rank = len(node.inputs[0].shape)  # type: ignore[arg-type]
                for k, array in ((1, [lo]), (2, [hi]), (3, [rank - 1]), (4, [1])):
                    value = self.constant(f"{node.name}_bound", np.array(array, np.int64))
                    if k < len(node.inputs):
                        node.replace_input_with(k, value)
                    else:
                        node.resize_inputs(k + 1)
                        node.replace_input_with(k, value)
                _set_last_dim(node.outputs[0], hi - lo)
            elif node not in done:
                done.add(node)
                sizes = [end - start for (start, end), p in zip(bounds, source.pieces) if p.node is node]
                if len(node.inputs) > 1 and node.inputs[1] is not None:
                    node.replace_input_with(1, self.constant(f"{node.name}_sizes", np.array(sizes, np.int64)))
                else:
                    node.attributes.pop("num_outputs", None)
                    node.attributes.pop("split", None)
                    if _opset(self.root, node) >= 13:
                        node.resize_inputs(2)
                        node.replace_input_with(1, self.constant(f"{node.name}_sizes", np.array(sizes, np.int64)))
                    else:
                        node.attributes.add(ir.AttrInt64s("split", sizes))
                for out, size in zip(node.outputs, sizes):
                    _set_last_dim(out, size)

    def reshape_last(self, node: ir.Node, size: int) -> None:
        """The Reshape's target shape with its last size replaced by ``size``."""
        shape = node.inputs[1]
        array = const_array(shape)
        if array is not None:
            new = array.copy()
            new[-1] = size
            node.replace_input_with(1, self.constant(shape.name or "lz_shape", new.astype(np.int64)))
        else:
            head = ir.Node(
                "",
                "Slice",
                [
                    shape,
                    self.constant("lz_zero", np.array([0], np.int64)),
                    self.constant("lz_minus_one", np.array([-1], np.int64)),
                ],
                name=self.names(f"{node.name}_lz_head"),
            )
            head.outputs[0].name = self.names(f"{node.name}_lz_head")
            concat = ir.Node(
                "",
                "Concat",
                [head.outputs[0], self.constant("lz_size", np.array([size], np.int64))],
                attributes=[ir.AttrInt64("axis", 0)],
                name=self.names(f"{node.name}_lz_shape"),
            )
            concat.outputs[0].name = self.names(f"{node.name}_lz_shape")
            self.scopes.insert_before(node, [head, concat])
            node.replace_input_with(1, concat.outputs[0])
        _set_last_dim(node.outputs[0], size)


def _opset(root: ir.Graph, node: ir.Node) -> int:
    model_opsets = root.opset_imports
    return int(model_opsets.get("", model_opsets.get("ai.onnx", 13)))


# ------------------------------------------------------------------------------------------------ the pass


@dataclasses.dataclass
class _Consumer:
    """``MatMul(A, W)`` / ``Gemm(A, W, C)`` reading ``A`` along the contraction axis."""

    node: ir.Node
    weight: _Matrix  # math form [K, N]

    @property
    def input(self) -> ir.Value:
        return self.node.inputs[0]  # type: ignore[return-value]


def _consumer(node: ir.Node) -> _Consumer | None:
    if not node.outputs or (not node.outputs[0].uses() and not node.outputs[0].is_graph_output()):
        return None  # dead: DCE's
    if _std(node, "MatMul") and len(node.inputs) == 2 and node.inputs[0] is not None:
        weight = _weight(node.inputs[1], own=True)
        a = node.inputs[0]
        if weight is None or a.shape is None or len(a.shape) < 2 or _weight(a) is not None:
            return None
        return _Consumer(node, _Matrix(node.inputs[1], weight))
    if _std(node, "Gemm") and not node.attributes.get_int("transA", 0) and node.inputs[0] is not None:
        raw = _weight(node.inputs[1], own=True)
        if raw is None or _weight(node.inputs[0]) is not None:
            return None
        transposed = bool(node.attributes.get_int("transB", 0))
        return _Consumer(node, _Matrix(node.inputs[1], raw, transposed, node.attributes.get_float("alpha", 1.0)))
    return None


class RemoveStructuredZeros(ir.passes.InPlacePass):
    """Slice away zero rows / columns / blocks of weights (module docstring: Cases 1-4)."""

    def __init__(self, assume_finite: bool = True) -> None:
        super().__init__()
        self.assume_finite = assume_finite
        self.removed_params = 0
        self.refusals: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not self.assume_finite:
            return ir.passes.PassResult(model, modified=False)
        names = NameFactory(model.graph)
        rewriter = _Rewriter(model.graph, names)
        removed = 0
        for graph in list(model.graphs()):
            for node in list(graph):
                if node.graph is None:
                    continue
                consumer = _consumer(node)
                if consumer is not None:
                    removed += self._narrow_chain(consumer, rewriter)
            # Cases 3 and 4: what Case 1 could not narrow keeps its width at the boundary.
            for node in list(graph):
                if node.graph is None:
                    continue
                removed += self._pad_output(node, rewriter)
                consumer = _consumer(node)
                if consumer is not None:
                    removed += self._slice_input(consumer, rewriter)
        if removed:
            self.removed_params += removed
            previous = int(model.metadata_props.get(PARAMS_REMOVED_KEY, "0") or 0)
            model.metadata_props[PARAMS_REMOVED_KEY] = str(previous + removed)
            logger.info("structured zeros: %d parameters removed", removed)
        return ir.passes.PassResult(model, modified=removed > 0)

    # Case 1 / 2
    def _narrow_chain(self, consumer: _Consumer, rewriter: _Rewriter) -> int:
        weight = consumer.weight
        width = weight.shape[0]
        dead_rows = weight.zero_rows()
        if dead_rows.all():
            return 0  # an all-zero weight: the lattice's
        a = consumer.input
        if _last_dim(a) not in (None, width) or width < 2:
            return 0
        chain = _Chain(width, self.assume_finite)
        try:
            known, vals = chain.visit(a)
        except _Refuse as exc:
            if dead_rows.any():  # pruned rows whose producer stays whole: say why (Case 4 may still slice)
                self._refuse(consumer, int(dead_rows.sum()), exc)
            else:
                logger.debug("structured zeros at %s: %s", consumer.node.name, exc)
            return 0
        dead = dead_rows | known
        if not dead.any():
            return 0
        try:
            chain.exclusive(consumer.node)
        except _Refuse as exc:
            self._refuse(consumer, int(dead.sum()), exc)
            return 0
        constant = known & ~dead_rows & (vals != 0)
        row = (vals[constant] @ weight.rows(np.flatnonzero(constant))) if constant.any() else None
        keep = np.flatnonzero(~dead)
        zero_consumer = keep.size == 0
        if zero_consumer:
            keep = np.array([0])  # one column stays, read by a zero weight row: the lattice folds the MatMul
        removed = chain.narrow(keep, rewriter)
        removed += self._narrow_consumer(consumer, keep, zero_consumer, row, rewriter)
        logger.debug(
            "structured zeros at %s: %d of %d entries dead, %d parameters removed",
            consumer.node.name,
            int(dead.sum()),
            width,
            removed,
        )
        return removed

    def _refuse(self, consumer: _Consumer, dead: int, exc: _Refuse) -> None:
        line = f"{_label(consumer.node)}: {dead} dead entries of its input, the chain computing it not narrowed: {exc}"
        self.refusals.append(line)
        logger.info("structured zeros at %s", line)

    @staticmethod
    def _narrow_consumer(
        consumer: _Consumer, keep: np.ndarray, zero: bool, row: np.ndarray | None, rewriter: _Rewriter
    ) -> int:
        node = consumer.node
        raw = const_array(node.inputs[1])
        assert raw is not None
        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        new = np.take(raw, keep, axis=1 if transposed else 0)
        if zero:
            new = np.zeros_like(new)
        removed = raw.size - new.size
        node.replace_input_with(1, rewriter.constant(node.inputs[1].name or "lz_weight", new))
        if row is None:
            return removed
        out = node.outputs[0]
        dtype = out.dtype.numpy() if out.dtype is not None else np.float32
        if node.op_type == "Gemm":
            beta = node.attributes.get_float("beta", 1.0)
            has_c = len(node.inputs) > 2 and node.inputs[2] is not None
            c = const_array(node.inputs[2]) if has_c else None
            if beta != 0 and (not has_c or (c is not None and c.size in (1, row.size))):
                base = np.zeros(row.size) if c is None else np.broadcast_to(c.reshape(-1), row.shape)
                merged = (base + row / beta).astype(dtype)
                if has_c:
                    node.replace_input_with(2, rewriter.constant(node.inputs[2].name or "lz_bias", merged))
                else:
                    node.resize_inputs(3)
                    node.replace_input_with(2, rewriter.constant(f"{node.name}_bias", merged))
                return removed
        # before: y = MatMul(A, W)   after: y = Add(MatMul(A', W'), row)
        add = ir.Node("", "Add", [out, rewriter.constant(f"{node.name}_row", row.astype(dtype))])
        add.name = rewriter.names(f"{node.name}_lz_row")
        new_out = add.outputs[0]
        new_out.name = rewriter.names(f"{out.name}_lz_row")
        new_out.shape, new_out.type = out.shape, out.type
        rewriter.scopes.insert_after(node, add)
        for user, index in list(out.uses()):
            if user is not add:
                user.replace_input_with(index, new_out)
        if out.is_graph_output():
            rename_output(node.graph, out, new_out, rewriter.names, "lz_before_row")
        return removed

    # Case 3
    def _pad_output(self, node: ir.Node, rewriter: _Rewriter) -> int:
        if not _std(node, "MatMul", "Gemm") or not node.outputs or not node.outputs[0].uses():
            return 0
        out = node.outputs[0]
        leaf = None
        uses = out.uses()
        if len(uses) == 1 and _std(uses[0][0], "Add") and not out.is_graph_output():
            leaf = _linear(uses[0][0].outputs[0])  # x @ W + b, the bias Add included
        if leaf is None:
            leaf = _linear_node(out)
        if leaf is None or _weight(node.inputs[0]) is not None:
            return 0
        if not leaf.out.uses() or leaf.out.is_graph_output():
            return 0
        zero = leaf.zero_columns() & (leaf.column_values() == 0)
        lead, trail = _run_lengths(zero)
        width = leaf.width
        if not _worth_a_node(leaf.weight.shape, width, int(zero.sum())):
            return 0  # nothing worth a Pad, or an all-zero weight (the lattice's)
        rank = len(leaf.out.shape) if leaf.out.shape is not None else None
        if rank is None or rank < 1:
            return 0
        target = leaf.out
        original_shape, original_type = target.shape, target.type
        live = np.flatnonzero(~zero)
        ends_only = lead + trail == int(zero.sum())
        removed = rewriter.narrow_linear(leaf, live)
        if ends_only:
            # before: y = x @ W + b     after: y = Pad(x @ W[:, lead:-trail] + b[lead:-trail], zeros)
            pad = self._pad(node, target, rank, lead, trail, rewriter)
            nodes, new = [pad], pad.outputs[0]
        else:
            # Interior zero columns (head 2 of 4): one zero column appended, then each column gathered from its
            # live position or from that zero.
            # before: y = x @ W     after: y = Gather(Pad(x @ W[:, live], 1 zero column), index, axis=-1)
            pad = self._pad(node, target, rank, 0, 1, rewriter)
            index = np.full(width, len(live), np.int64)
            index[live] = np.arange(len(live))
            gather = ir.Node(
                "",
                "Gather",
                [pad.outputs[0], rewriter.constant(f"{node.name}_columns", index)],
                attributes=[ir.AttrInt64("axis", rank - 1)],
                name=rewriter.names(f"{node.name}_lz_gather"),
            )
            nodes, new = [pad, gather], gather.outputs[0]
        new.name = rewriter.names(f"{target.name}_lz_padded")
        new.shape, new.type = original_shape, original_type
        producer = target.producer()
        assert producer is not None and producer.graph is not None
        rewriter.scopes.insert_after(producer, nodes)
        for user, index in list(target.uses()):
            if user is not pad:
                user.replace_input_with(index, new)
        logger.debug(
            "structured zeros at %s: %d zero output columns restored after a narrower MatMul, %d parameters removed",
            _label(node),
            int(zero.sum()),
            removed,
        )
        return removed

    @staticmethod
    def _pad(node: ir.Node, target: ir.Value, rank: int, lead: int, trail: int, rewriter: _Rewriter) -> ir.Node:
        """``Pad(target)`` with zeros: ``lead`` / ``trail`` columns before / after its last axis."""
        pads = [0] * (rank - 1) + [lead] + [0] * (rank - 1) + [trail]
        if _opset(rewriter.root, node) >= 11:
            pad = ir.Node("", "Pad", [target, rewriter.constant(f"{node.name}_pads", np.array(pads, np.int64))])
        else:
            pad = ir.Node("", "Pad", [target], attributes=[ir.AttrInt64s("pads", pads)])
        pad.name = rewriter.names(f"{node.name}_lz_pad")
        pad.outputs[0].name = rewriter.names(f"{target.name}_lz_pad")
        pad.outputs[0].dtype = target.dtype
        return pad

    # Case 4
    def _slice_input(self, consumer: _Consumer, rewriter: _Rewriter) -> int:
        weight = consumer.weight
        width = weight.shape[0]
        zero = weight.zero_rows()
        lead, trail = _run_lengths(zero)
        if not _worth_a_node(weight.shape, width, int(zero.sum())):
            return 0
        node = consumer.node
        a = consumer.input
        rank = len(a.shape) if a.shape is not None else None
        if rank is None or rank < 1 or _last_dim(a) not in (None, width):
            return 0
        live = np.flatnonzero(~zero)
        if lead + trail != int(zero.sum()):
            # Interior zero rows: before: y = A @ W     after: y = Gather(A, live, axis=-1) @ W[live]
            cut = ir.Node(
                "",
                "Gather",
                [a, rewriter.constant(f"{node.name}_live", live.astype(np.int64))],
                attributes=[ir.AttrInt64("axis", rank - 1)],
            )
            return self._read_live(consumer, cut, live, rewriter)
        # before: y = A @ W     after: y = Slice(A, lead:K-trail, last axis) @ W[lead:K-trail]
        bounds = [
            rewriter.constant(f"{node.name}_starts", np.array([lead], np.int64)),
            rewriter.constant(f"{node.name}_ends", np.array([width - trail], np.int64)),
            rewriter.constant(f"{node.name}_axes", np.array([rank - 1], np.int64)),
        ]
        if _opset(rewriter.root, node) >= 10:
            cut = ir.Node("", "Slice", [a, *bounds])
        else:
            cut = ir.Node(
                "",
                "Slice",
                [a],
                attributes=[
                    ir.AttrInt64s("starts", [lead]),
                    ir.AttrInt64s("ends", [width - trail]),
                    ir.AttrInt64s("axes", [rank - 1]),
                ],
            )
        return self._read_live(consumer, cut, live, rewriter)

    @staticmethod
    def _read_live(consumer: _Consumer, cut: ir.Node, live: np.ndarray, rewriter: _Rewriter) -> int:
        """The consumer reads ``cut``'s output (the live entries of its input) with the live rows of its weight."""
        node, a = consumer.node, consumer.input
        cut.name = rewriter.names(f"{node.name}_lz_live")
        sliced = cut.outputs[0]
        sliced.name = rewriter.names(f"{a.name}_lz_live")
        sliced.dtype = a.dtype
        if a.shape is not None:
            sliced.shape = a.shape
            _set_last_dim(sliced, len(live))
        rewriter.scopes.insert_before(node, cut)
        node.replace_input_with(0, sliced)
        raw = const_array(node.inputs[1])
        assert raw is not None
        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        new = np.take(raw, live, axis=1 if transposed else 0)
        node.replace_input_with(1, rewriter.constant(node.inputs[1].name or "lz_weight", new))
        logger.debug("structured zeros at %s: its input read at %d live entries", _label(node), len(live))
        return raw.size - new.size


def _worth_a_node(shape: tuple[int, int], width: int, dead: int) -> bool:
    """Cases 3 / 4 add a Pad or Slice: only for a weight with both axes real (a router's few logits are left
    alone: solidify drops its rows) losing at least 1/64 of ``width``, and never all of it (an all-zero weight is
    the lattice's)."""
    return min(shape) >= _MIN_WIDTH and max(1, width // 64) <= dead < width


def _run_lengths(zero: np.ndarray) -> tuple[int, int]:
    """Lengths of the leading and trailing runs of True."""
    if zero.all():
        return len(zero), 0
    lead = int(np.argmin(zero))
    trail = int(np.argmin(zero[::-1]))
    return lead, trail
