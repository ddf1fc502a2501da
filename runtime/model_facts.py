"""Facts of a model a server checks requests against, read from its ONNX file (dims only, no weights): which
integer inputs index a weight's rows (``index_ranges``: a token id's range) and which inputs may have a zero
dim (``empty_axes``: a KV cache's past on a client's first step)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["empty_axes", "index_ranges"]


#: Ops that pass a tensor on with its dims (an empty past stays an empty past) on the way to its Concat.
_PASS_DIMS = frozenset({"Cast", "Identity"})


def empty_axes(model_path: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Inputs that may come with a dim of 0 and on which axes: name -> axes. Weights are not loaded (dims only).

    An axis qualifies when it is symbolic in the model and the input only reaches a ``Concat`` along that axis
    (through ``Cast`` / ``Identity``), its shape aside (``Shape``, ``Size``): a KV cache's past, empty on a
    client's first step (``[1, heads, 0, head_dim]``), to which the step's keys are appended. Anything else (an
    empty ``input_ids``) is still refused: nothing says the model can take it.
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    uses: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            uses.setdefault(name, []).append(node)
    initializers = {t.name for t in graph.initializer}
    axes: dict[str, list[int]] = {}
    for value in graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        rank = len(dims)
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") or not _reaches_concat_only(value.name, axis, rank, uses):
                continue
            axes.setdefault(value.name, []).append(axis)
    return axes


def _reaches_concat_only(name: str, axis: int, rank: int, uses: dict[str, list[Any]], depth: int = 0) -> bool:
    """Whether ``name`` reaches at least one ``Concat`` along ``axis`` and nothing else but its shape."""
    concats = 0
    for node in uses.get(name, []):
        if node.op_type in ("Shape", "Size"):
            continue
        if node.op_type in _PASS_DIMS and depth < 4:
            if not _reaches_concat_only(node.output[0], axis, rank, uses, depth + 1):
                return False
            concats += 1
            continue
        along = next((a.i for a in node.attribute if a.name == "axis"), None)
        if node.op_type != "Concat" or along is None or along % rank != axis:
            return False
        concats += 1
    return concats > 0


def index_ranges(model_path: str | os.PathLike[str]) -> dict[str, int]:
    """Integer inputs used only as row indices of a weight (``Gather(W, ids)``, an embedding): name -> rows.

    What a token id may be: ``0 <= id < rows``. Weights are not loaded (dims only).
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    rows = {t.name: t.dims[0] for t in graph.initializer if len(t.dims) >= 1}
    ints = {v.name for v in graph.input if v.type.tensor_type.elem_type in (2, 3, 4, 5, 6, 7, 12, 13)} - set(rows)
    ranges: dict[str, int] = {}
    for name in ints:
        uses = [n for n in graph.node if name in n.input]
        limits = []
        for node in uses:
            if node.op_type in ("Shape", "Size"):  # reads the ids' shape, not their values
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if node.op_type != "Gather" or axis != 0 or list(node.input).index(name) != 1 or node.input[0] not in rows:
                break
            limits.append(rows[node.input[0]])
        else:
            if limits:
                ranges[name] = min(limits)
    return ranges
