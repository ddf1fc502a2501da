"""The small integer evaluator of structured zeros: shape and bound tensors from constants and static dims."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._structured.leaves import STD, static_dims

# Int ops the bound evaluator follows (chunk's Slice bounds from Shape).
INT_OPS = frozenset({"Gather", "Add", "Sub", "Mul", "Div", "Cast", "Unsqueeze", "Squeeze", "Concat", "Identity",
                     "Slice", "Reshape", "Shape", "Constant"})  # fmt: skip


def int_vector(value: ir.Value | None, depth: int = 0) -> list[int | None] | None:
    """Contents of a small int tensor computed from constants and static dims (None entries: unknown sizes)."""
    if value is None or depth > 24:
        return None
    array = const_array(value)
    if array is not None:
        return [int(x) for x in array.reshape(-1)] if array.dtype.kind in "iu" and array.size <= 16 else None
    node = value.producer()
    if node is None or node.domain not in STD or node.op_type not in INT_OPS:
        return None
    op = node.op_type
    if op == "Shape":
        dims = static_dims(node.inputs[0])
        if dims is None:
            return None
        rank = len(dims)
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)
        return dims[slice(start + rank if start < 0 else start, end + rank if end < 0 else end)]
    ins = [int_vector(v, depth + 1) if v is not None else None for v in node.inputs[:1]]
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
        parts = [int_vector(v, depth + 1) for v in node.inputs]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]  # type: ignore[union-attr]
    other = int_vector(node.inputs[1], depth + 1)
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


