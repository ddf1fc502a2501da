"""Backward matching over producers: the checks every part of the MoE matcher shares.

A part walks from a value to the nodes that produce it (``Walk.node``), accepts each node it checks and
raises ``NoMatch`` with the failed check otherwise. ``commuted`` generates both operand orders of a
commutative node, so no rule is written twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array

__all__ = [
    "STD", "NoMatch", "Walk", "attr_of", "axes_of", "commuted", "const_ints", "const_scalar", "const_weight",
    "near", "need", "rank_of", "sorted_axes", "static_dim",
]  # fmt: skip

STD = ("", "ai.onnx")


class NoMatch(Exception):
    """A check of the matcher failed; the message says which."""


def need(condition: bool, reason: str) -> None:
    if not condition:
        raise NoMatch(reason)


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
        self.deepest: tuple[int, str] = (-1, "")  # the failed attempt that matched most nodes, and why

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
        """Run ``fn``; on NoMatch forget the nodes it accepted and re-raise."""
        mark = len(self.nodes)
        try:
            return fn()
        except NoMatch as exc:
            self.note(exc)
            del self.nodes[mark:]
            raise

    def note(self, exc: NoMatch) -> None:
        if len(self.nodes) > self.deepest[0]:
            self.deepest = (len(self.nodes), str(exc))


def const_weight(value: ir.Value, rank: int, what: str) -> np.ndarray:
    array = const_array(value)
    need(array is not None, f"{what}: {value.name} is not a constant weight")
    need(array.ndim == rank, f"{what}: {value.name} has shape {list(array.shape)}, expected rank {rank}")
    need(array.dtype.kind == "f", f"{what}: {value.name} has dtype {array.dtype}, expected a float type")
    return array
