"""Cases 1 and 2 of structured zeros: the chain computing a consumer's input along its last axis, and its narrowing.

A check that fails raises :class:`~layerzero.passes._match.NoMatch` (the reason, the node it stopped at).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._lattice import ELEMENTWISE_BINARY, UNARY, UNARY_ATTR
from layerzero.passes._match import NoMatch
from layerzero.passes._quantized import is_matmul_nbits
from layerzero.passes._shape_rules import VECTOR_OPS, split_sizes
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes._structured.leaves import (
    STD,
    Linear,
    bias_vector,
    last_dim,
    linear,
    node_label,
    set_last_dim,
    static_dims,
    std,
)


class Rewriter(Protocol):
    """What narrowing a chain asks of the rewriter (``_structured.rewrite.Rewriter``; a protocol, so that the
    chain does not import the module that imports it)."""

    def narrow_linear(self, linear: Any, keep: np.ndarray) -> int: ...

    def rewrite_pieces(self, source: Source, bounds: Any) -> None: ...

    def constant(self, name: str, value: np.ndarray) -> ir.Value: ...

    def reshape_last(self, node: ir.Node, width: int) -> None: ...

MAX_CHAIN = 48  # values in one chain: an MLP has a handful; more is a residual stream walked back
# Binary ops of Case 1 that act per element (broadcast operands keep their columns).
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum"})


@dataclasses.dataclass
class Piece:
    """One piece (Split output or Slice) of a fused linear leaf along its last axis."""

    node: ir.Node  # the Split or Slice
    output: int  # which output of a Split
    offset: int
    width: int


@dataclasses.dataclass
class Source:
    linear: Linear
    pieces: list[Piece]  # the Split's pieces in output order (Split), or the Slices reading the source
    in_chain: set[int]  # indices into pieces that belong to the chain


class Chain:
    """The values computing a consumer's input ``A`` along its last axis (width ``K``), and how to narrow them."""

    def __init__(self, width: int, assume_finite: bool) -> None:
        self.width = width
        self.assume_finite = assume_finite
        self.values: dict[ir.Value, tuple[np.ndarray, np.ndarray]] = {}  # value -> (known, column values)
        self.nodes: set[ir.Node] = set()
        self.leaves: list[Linear] = []
        self.sources: dict[ir.Value, Source] = {}
        self.constants: list[tuple[ir.Node, int]] = []  # (node, input index) of a constant with the K axis
        self.reshapes: list[ir.Node] = []

    # the analysis ------------------------------------------------------------------------------------------
    def visit(self, value: ir.Value) -> tuple[np.ndarray, np.ndarray]:
        if value in self.values:
            return self.values[value]
        if len(self.values) >= MAX_CHAIN:
            raise NoMatch(f"{value.name}: more than {MAX_CHAIN} values in the chain (a residual stream)")
        # An unknown last size (chunk's Slices leave shape inference without one) is proved by the producer.
        if value.is_graph_output() or value.is_graph_input() or last_dim(value) not in (None, self.width):
            raise NoMatch(f"{value.name}: not a width-{self.width} intermediate")
        node = value.producer()
        if node is None or (node.domain not in STD and not is_matmul_nbits(node)) or len(node.outputs) < 1:
            raise NoMatch(f"{value.name}: no standard producer")
        result = self._visit_node(node, value)
        self.values[value] = result
        return result

    def _unknown(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.width, bool), np.zeros(self.width)

    def _visit_node(self, node: ir.Node, value: ir.Value) -> tuple[np.ndarray, np.ndarray]:
        op = node.op_type
        leaf = linear(value)
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
            in_dims, out_dims = static_dims(node.inputs[0]), static_dims(value)
            if not in_dims or not out_dims or in_dims[-1] not in (None, self.width):
                raise NoMatch(f"{node.name}: a Reshape that does not keep the last axis", node)
            shape = SymbolicShapes().ints(node.inputs[1])
            if shape is None or shape[-1] != self.width:
                raise NoMatch(f"{node.name}: the Reshape's last size is not provably {self.width}", node)
            self.reshapes.append(node)
            return self.visit(node.inputs[0])
        if op in BINARY and op in ELEMENTWISE_BINARY and len(node.inputs) >= 2:
            return self._binary(node)
        raise NoMatch(f"{node.name}: {op} is not narrowed along the last axis", node)

    def _binary(self, node: ir.Node) -> tuple[np.ndarray, np.ndarray]:
        states: list[tuple[np.ndarray, np.ndarray]] = []
        for k, operand in enumerate(node.inputs):
            if operand is None:
                raise NoMatch(f"{node.name}: missing operand", node)
            array = const_array(operand)
            if array is not None:
                if array.ndim >= 1 and array.shape[-1] == self.width and self.width != 1:
                    self.constants.append((node, k))
                    vector = bias_vector(array, self.width)
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
                    raise NoMatch(f"{node.name}: a constant operand that does not broadcast along the last axis", node)
                continue
            last = last_dim(operand)
            if last == 1 or (operand.shape is not None and len(operand.shape) == 0):
                states.append(self._unknown())  # broadcast along the last axis: untouched
            elif last in (None, self.width) and operand.shape is not None:
                states.append(self.visit(operand))
            else:
                reason = f"{node.name}: operand {operand.name} is not provably broadcast along the last axis"
                raise NoMatch(reason, node)
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
            raise NoMatch(f"{node.name}: no data input", node)
        rank = len(source_value.shape) if source_value.shape is not None else None
        if rank is None:
            raise NoMatch(f"{node.name}: source rank unknown", node)
        source = self.sources.get(source_value)
        if source is None:
            leaf = linear(source_value)
            if leaf is None:
                raise NoMatch(f"{node.name}: {node.op_type} of a value that is no linear leaf", node)
            source = Source(leaf, pieces_of(source_value, rank, leaf.width), set())
            self.sources[source_value] = source
            self.nodes.update(leaf.nodes())
        for i, piece in enumerate(source.pieces):
            if piece.node is node and node.outputs[piece.output] is value:
                if piece.width != self.width:
                    raise NoMatch(f"{node.name}: piece of width {piece.width}, chain width {self.width}", node)
                source.in_chain.add(i)
                self.nodes.add(node)
                lo, hi = piece.offset, piece.offset + piece.width
                return source.linear.zero_columns()[lo:hi], source.linear.column_values()[lo:hi]
        raise NoMatch(f"{node.name}: not a piece of {source_value.name}", node)

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
                raise NoMatch(f"{source.linear.out.name}: its pieces changed while reading")
        for value in changed:
            if value.is_graph_output():
                raise NoMatch(f"{value.name} is a graph output")
            for user, _index in value.uses():
                if user in readers:
                    continue
                if std(user, "Shape") and self._shape_is_harmless(user):
                    continue
                raise NoMatch(f"{value.name} is also read by {node_label(user)} ({user.op_type})")

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
                if user.domain not in STD or user.op_type not in VECTOR_OPS or value.is_graph_output():
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
    def narrow(self, keep: np.ndarray, rewriter: Rewriter) -> int:
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
            set_last_dim(value, len(keep))
        return removed


def pieces_of(source: ir.Value, rank: int, width: int) -> list[Piece]:
    """The Split or Slices reading ``source`` along its last axis, as pieces; refuses anything else."""
    pieces: list[Piece] = []
    for user, index in source.uses():
        if index != 0:
            raise NoMatch(f"{source.name}: read as a non-data input by {user.name}")
        if std(user, "Split"):
            if user.attributes.get_int("axis", 0) % rank != rank - 1:
                raise NoMatch(f"{user.name}: Split not along the last axis", user)
            sizes = split_sizes(user, width)
            if None in sizes:
                raise NoMatch(f"{user.name}: run-time split sizes", user)
            offset = 0
            for i, size in enumerate(sizes):
                pieces.append(Piece(user, i, offset, size))
                offset += size
        elif std(user, "Slice"):
            ints = SymbolicShapes().ints  # the passes' one integer evaluator, on inference's dims
            starts, ends = ints(user.inputs[1]), ints(user.inputs[2])
            axes = ints(user.inputs[3]) if len(user.inputs) > 3 and user.inputs[3] is not None else [0]
            steps = ints(user.inputs[4]) if len(user.inputs) > 4 and user.inputs[4] is not None else [1]
            if None in (starts, ends, axes, steps) or len(starts) != 1 or len(axes) != 1:  # type: ignore[arg-type]
                raise NoMatch(f"{user.name}: Slice bounds not provably constant along one axis", user)
            if None in starts + ends + axes + steps or axes[0] % rank != rank - 1 or steps[0] != 1:  # type: ignore[operator]
                raise NoMatch(f"{user.name}: Slice not a step-1 range of the last axis", user)
            lo, hi, _ = slice(starts[0], ends[0]).indices(width)  # type: ignore[index]
            if hi <= lo:
                raise NoMatch(f"{user.name}: empty slice", user)
            pieces.append(Piece(user, 0, lo, hi - lo))
        elif std(user, "Shape"):
            continue  # chunk's bound computation: checked by the Slices' evaluation, replaced by constants
        else:
            raise NoMatch(f"{source.name}: read by {user.name} ({user.op_type})")
    splits = {p.node for p in pieces if p.node.op_type == "Split"}
    if splits and len({p.node for p in pieces}) > 1:
        # The narrowed source is the pieces laid end to end: a Split must be its only reader to partition it.
        raise NoMatch(f"{source.name}: a Split next to other readers")
    return pieces
