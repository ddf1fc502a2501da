"""Backward matching over producers: the checks every part of the MoE matcher shares.

A part walks from a value to the nodes that produce it (``Walk.node``), accepts each node it checks and
raises ``NoMatch`` with the failed check otherwise. ``commuted`` generates both operand orders of a
commutative node, so no rule is written twice.

The failure vocabulary is the passes' own (``passes/_match.py``): ``NoMatch`` / ``need`` are re-exported from
there, a walk's failures carry how far they got (``progress``: the nodes the walk had accepted), and where
several variants are tried the furthest attempt wins (``furthest_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._match import Attempts, NoMatch, label, need
from layerzero.passes._shapes import SymbolicShapes

__all__ = [
    "STD",
    "Attempts",
    "NoMatch",
    "Walk",
    "attr_of",
    "axes_of",
    "commuted",
    "const_ints",
    "const_scalar",
    "const_weight",
    "furthest_of",
    "label",
    "near",
    "need",
    "rank_of",
    "reshape_dims",
    "sorted_axes",
    "static_dim",
    "static_ints",
    "zeros_node",
]  # fmt: skip

STD = ("", "ai.onnx")


def furthest_of(attempts: Attempts, none: str = "no variant", ties: str = "join") -> NoMatch:
    """The failure of ``attempts`` that got furthest. Where several got equally far: ``ties="join"`` (variants)
    one failure with each of their reasons (none says better than the others why it stopped); ``"last"``
    (the two operand orders of a commutative node) the last one tried."""
    best = attempts.best()
    if best is None:
        return NoMatch(none)
    tied = [f for f in attempts.failures if f.progress == best.progress]
    if len(tied) == 1:
        return best
    if ties == "last":
        return tied[-1]
    return NoMatch("; ".join(f.reason for f in tied), *best.nodes, progress=best.progress)


def const_ints(value: ir.Value | None) -> list[int] | None:
    array = const_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def attr_of(node: ir.Node, name: str, default: object = None) -> object:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def rank_of(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def static_dim(value: ir.Value, axis: int) -> int | None:
    if value.shape is None or not -len(value.shape) <= axis < len(value.shape):
        return None
    d = value.shape[axis]
    return d if isinstance(d, int) else None


def axes_of(node: ir.Node) -> list[int] | None:
    """Reduce/Squeeze/Unsqueeze axes, from the input (opset ≥ 13/18) or the attribute."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return const_ints(node.inputs[1])
    axes = attr_of(node, "axes")
    return None if axes is None else [int(a) for a in axes]


def sorted_axes(axes: list[int] | None, rank: int) -> list[int] | None:
    return None if axes is None else sorted(a + rank if a < 0 else a for a in axes)


def commuted(node: ir.Node) -> Iterator[tuple[ir.Value, ir.Value]]:
    a, b = node.inputs[0], node.inputs[1]
    yield a, b
    yield b, a


def near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def const_scalar(value: ir.Value) -> float | None:
    array = const_array(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


class Walk:
    """Backward matching over producers, remembering every computing node it accepts."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        # Cheap router-side nodes other blocks may share (an exporter's CSE merges equal zeros / sums).
        self.shareable: set[ir.Node] = set()
        # The failed attempt that matched most nodes: why, with the last node it accepted (where it stopped)
        # and how many it had (its progress).
        self.deepest: NoMatch | None = None
        # The passes' one integer-vector evaluator, on demand (inference's dims; the graph is not changed while
        # a walk matches).
        self.shapes = SymbolicShapes()

    def node(self, value: ir.Value | None, ops: str | tuple[str, ...], what: str) -> ir.Node:
        ops = (ops,) if isinstance(ops, str) else ops
        producer = None if value is None else value.producer()
        if producer is None or producer.op_type not in ops or producer.domain not in STD:
            found = "nothing" if value is None else ("a graph input or constant" if producer is None else "")
            if producer is not None:
                found = f"{producer.op_type} ({producer.name})"
            raise NoMatch(f"{what}: expected {' or '.join(ops)}, found {found}")
        if producer not in self.nodes:
            self.nodes.append(producer)
        return producer

    def attempt(self, fn: Callable[[], object]) -> object:
        """Run ``fn``; on NoMatch forget the nodes it accepted and re-raise it with the walk's progress (the
        nodes accepted when it failed), so variants tried in turn compare by how far each got."""
        mark = len(self.nodes)
        try:
            return fn()
        except NoMatch as exc:
            self.note(exc)
            exc.progress = max(exc.progress, len(self.nodes))
            if not exc.nodes and self.nodes:
                exc.nodes = (self.nodes[-1],)
            del self.nodes[mark:]
            raise

    def note(self, exc: NoMatch) -> None:
        """Keep ``exc`` as the deepest failure when the walk has accepted more nodes than at the last one."""
        if self.deepest is None or len(self.nodes) > self.deepest.progress:
            last = self.nodes[-1:]
            self.deepest = NoMatch(exc.reason, *last, progress=len(self.nodes))


def const_weight(value: ir.Value, rank: int, what: str) -> np.ndarray:
    array = const_array(value)
    need(array is not None, f"{what}: {value.name} is not a constant weight")
    need(array.ndim == rank, f"{what}: {value.name} has shape {list(array.shape)}, expected rank {rank}")
    need(array.dtype.kind == "f", f"{what}: {value.name} has dtype {array.dtype}, expected a float type")
    return array


def reshape_dims(node: ir.Node) -> list[int] | None:
    """The target shape of a ``Reshape``, ``-1`` for the one dim left to infer: the constant shape input, or
    (TorchScript exports build it with ``Shape`` / ``Gather`` / ``Concat``) the inferred output shape when at
    most one of its dims is not static; such a shape determines the Reshape exactly as the constant would."""
    shape = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    if shape is not None:
        return shape
    out = node.outputs[0].shape
    if out is None:
        return None
    dims = [d if isinstance(d, int) else -1 for d in out]
    return dims if dims.count(-1) <= 1 else None


def static_ints(w: Walk, value: ir.Value | None) -> list[int] | None:
    """An integer vector known at compile time: a constant, or computed from static dims of ``Shape`` (TorchScript's
    ``chunk`` bounds: ``(Shape(x)[-1] + 1) / 2 * i``), by the passes' one evaluator (``SymbolicShapes``, its op
    table in ``passes/_shape_rules.py``). The nodes it reads are accepted into the walk as shareable (they compute
    the block's bounds; what else reads them keeps them)."""
    found = w.shapes.static_vector(value)
    if found is None:
        return None
    ints, nodes = found
    for node in nodes:
        if node not in w.nodes:
            w.nodes.append(node)
    # Shape arithmetic other shape computations may read too (TorchScript shares it): it goes when dead.
    w.shareable.update(nodes)
    return ints


def zeros_node(w: Walk, value: ir.Value, what: str) -> ir.Node:
    """``value`` is all zeros: ``ConstantOfShape(0)`` or ``Expand(0, shape)`` (torch's ``zeros``)."""
    node = w.node(value, ("ConstantOfShape", "Expand"), what)
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        zero = fill is None or not np.any(fill.value.numpy())
    else:
        fill = const_array(node.inputs[0])
        zero = fill is not None and fill.size == 1 and not np.any(fill)
    need(zero, f"{what} is not 0")
    w.shareable.add(node)
    return node
