"""Algebraic simplifications that zeroing leaves behind (a layer removed between two reshuffles)."""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._graph import NameFactory, const_array, replace_value

__all__ = ["SimplifyConcatSplit"]


def _axis(value: ir.Value, axis: int) -> int | None:
    rank = len(value.shape) if value.shape is not None else None
    if rank is None:
        return None
    return axis + rank if axis < 0 else axis


class SimplifyConcatSplit(ir.passes.InPlacePass):
    """Split of a Concat along the same axis into the same pieces gives the pieces back.

    Cases:
    1. ``Split(Concat(a, b, ..., axis=k), axis=k)`` whose split sizes equal the static sizes of
       ``a, b, ...`` on axis k: the Split's outputs are replaced by ``a, b, ...``.
       # Split(Concat(a, b)) -> a, b
       (A bypassed rotary encoding leaves exactly this: q and k stacked for it, then unstacked.)
    Both the ``split`` input (opset 13+) and the ``num_outputs`` / ``split`` attribute forms are read.
    The Concat stays when something else reads it; DCE removes it otherwise.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = NameFactory(model.graph)
        modified = False
        for graph in list(model.graphs()):
            for node in list(graph):
                if node.op_type == "Split" and node.domain in ("", "ai.onnx"):
                    modified |= self._fold(node, names)
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _fold(split: ir.Node, names: NameFactory) -> bool:
        data = split.inputs[0]
        concat = data.producer() if data is not None else None
        if concat is None or concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
            return False
        pieces = list(concat.inputs)
        if len(pieces) != len(split.outputs) or any(p is None for p in pieces):
            return False
        axis = _axis(data, split.attributes.get_int("axis", 0))
        if axis is None or axis != _axis(data, concat.attributes.get_int("axis", 0)):
            return False
        sizes = []
        for piece in pieces:
            shape = piece.shape
            if shape is None or len(shape) <= axis or not isinstance(shape[axis], int):
                return False
            sizes.append(int(shape[axis]))
        if len(split.inputs) > 1 and split.inputs[1] is not None:
            given = const_array(split.inputs[1])
            if given is None or [int(x) for x in given.reshape(-1)] != sizes:
                return False
        elif "split" in split.attributes:
            if list(split.attributes.get_ints("split", [])) != sizes:
                return False
        elif len(set(sizes)) != 1:  # num_outputs: equal parts
            return False
        for out, piece in zip(split.outputs, pieces):
            if out.dtype is not None and piece.dtype is not None and out.dtype != piece.dtype:
                return False
        for out, piece in zip(split.outputs, pieces):
            replace_value(out, piece, names)
        return True
