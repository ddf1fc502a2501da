"""The small matchers ``FuseDecoder`` (``passes/fuse_decoder.py``) builds its patterns from: one producer of a kind,
a scalar constant, a value read only by the pattern, constant axes, static ranks and dims."""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._match import need

__all__ = ["const_axes", "int_attr", "last_dim", "only_reader", "other_input", "rank_of", "reshaped_once",
           "scalar_of", "single"]  # fmt: skip


def single(node: ir.Node | None, op_type: str, *seen: ir.Node) -> ir.Node:
    need(node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx"),
         f"expected {op_type}, found {node.op_type if node is not None else 'a graph input or constant'}",
         *seen, *([node] if node is not None else []))  # fmt: skip
    assert node is not None
    return node


def scalar_of(value: ir.Value | None) -> float | None:
    array = const_array(value)
    if array is None or array.size != 1 or array.dtype.kind not in "fiu":
        return None
    return float(array.reshape(()))


def only_reader(value: ir.Value, reader: ir.Node, *seen: ir.Node) -> None:
    need(not value.is_graph_output() and all(use.node is reader for use in value.uses()),
         f"{value.name} is read outside the pattern", *seen)  # fmt: skip


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a binary node one of whose inputs is ``value``."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def const_axes(node: ir.Node) -> list[int] | None:
    """A Reduce / Unsqueeze node's constant axes (input 1 or the attribute), None when not constant."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        return None if array is None else [int(a) for a in array.reshape(-1)]
    attr = node.attributes.get("axes")
    return None if attr is None else [int(a) for a in attr.as_ints()]


def int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


def reshaped_once(value: ir.Value, what: str, seen: list[ir.Node]) -> ir.Node:
    """The one ``Reshape`` that reads ``value`` (as its data), appended to ``seen`` (raises ``NoMatch``)."""
    uses = list(value.uses())
    need(len(uses) == 1 and uses[0].node.op_type == "Reshape" and uses[0].idx == 0 and not value.is_graph_output(),
         f"{what} is not reshaped once", *seen)  # fmt: skip
    seen.append(uses[0].node)
    return uses[0].node


def rank_of(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def last_dim(value: ir.Value) -> int | None:
    if value.shape is None or not len(value.shape):
        return None
    dim = value.shape[-1]
    return dim if isinstance(dim, int) else None
