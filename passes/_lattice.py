"""The uniform-value lattice (DESIGN.md): unknown · uniform(c) · constant.

A value is *uniform* when every element equals one scalar ``c``; its shape is the value's own
(inferred, possibly symbolic) shape. This module holds the transfer functions: given the uniform
scalars of a node's inputs (None = unknown), the uniform scalars of its outputs.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array

__all__ = ["UNIFORM_META_KEY", "transfer", "uniform_of_constant"]

UNIFORM_META_KEY = "layerzero.uniform"
_PROBE = 4096  # elements looked at before reading a whole tensor (keeps memory-mapped weights cold)

_erf = np.vectorize(math.erf, otypes=[np.float64])

_UNARY = {
    "Abs": np.abs,
    "Ceil": np.ceil,
    "Cos": np.cos,
    "Cosh": np.cosh,
    "Erf": _erf,
    "Exp": np.exp,
    "Floor": np.floor,
    "Identity": lambda x: x,
    "Log": np.log,
    "Neg": np.negative,
    "Not": np.logical_not,
    "Reciprocal": np.reciprocal,
    "Relu": lambda x: np.maximum(x, 0),
    "Round": np.round,
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Sign": np.sign,
    "Sin": np.sin,
    "Sinh": np.sinh,
    "Softplus": lambda x: np.log1p(np.exp(x)),
    "Sqrt": np.sqrt,
    "Tan": np.tan,
    "Tanh": np.tanh,
    "Cast": lambda x: x,  # the dtype conversion happens on the way out
    "CastLike": lambda x, _like=None: x,
}


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(np.true_divide(a, b)).astype(a.dtype)
    return np.true_divide(a, b)


_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _div,
    "Pow": np.power,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
    "Equal": np.equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
}
_VARIADIC = {"Sum": np.add, "Max": np.maximum, "Min": np.minimum}

# Ops that only move, copy or select elements of their first input: a uniform input stays uniform.
_DATA_MOVEMENT = frozenset(
    {
        "Reshape",
        "Expand",
        "Transpose",
        "Unsqueeze",
        "Squeeze",
        "Flatten",
        "Slice",
        "Tile",
        "Gather",
        "GatherElements",
        "GatherND",
        "DepthToSpace",
        "SpaceToDepth",
        "ReduceMax",
        "ReduceMin",
        "ReduceMean",
        "MaxPool",
        "Split",
        "Compress",
    }
)


# numpy dtype kinds a uniform may have: bool, signed, unsigned, float. A uniform is materialised as
# ConstantOfShape, which cannot fill strings (nor, before opset 20, the ml_dtypes kinds).
_FILLABLE_KINDS = frozenset("biuf")


def _is_zero(c: np.ndarray | None) -> bool:
    return c is not None and not bool(c)


def uniform_of_constant(value: ir.Value) -> np.ndarray | None:
    """The scalar every element of a constant value equals, or None (cached on the value)."""
    cached = value.meta.get(UNIFORM_META_KEY)
    if cached is not None:
        return None if isinstance(cached, str) else cached
    result = _scan_constant(value)
    value.meta[UNIFORM_META_KEY] = "no" if result is None else result
    return result


def _scan_constant(value: ir.Value) -> np.ndarray | None:
    producer = value.producer()
    if producer is not None and producer.op_type == "ConstantOfShape" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        if attr is None:
            return np.array(0.0, dtype=np.float32)
        return np.asarray(attr.value.numpy()).reshape(-1)[0].copy()
    array = const_array(value)
    if array is None or array.size == 0 or array.dtype.kind not in _FILLABLE_KINDS:
        return None
    flat = array.reshape(-1)
    first = flat[0]
    if np.issubdtype(flat.dtype, np.floating) and not np.isfinite(first):
        return None
    # Real weights fail on the first few elements: only all-equal tensors are read whole.
    if not np.all(flat[:_PROBE] == first):
        return None
    uniform = all(np.all(flat[s : s + (1 << 22)] == first) for s in range(_PROBE, flat.size, 1 << 22))
    read_whole = flat.size > _PROBE
    del array, flat
    if read_whole:
        _release_pages(value)
    return np.asarray(first).copy() if uniform else None


def _release_pages(value: ir.Value) -> None:
    """Unmap a memory-mapped weight that was read whole: its pages leave the process's RSS.

    The tensor maps its file again when next read. An all-zero weight of a big model would
    otherwise stay resident for the whole compile.
    """
    tensor = value.const_value
    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):  # a view of it is still alive elsewhere: keep the map
            tensor.release()


def _out_dtype(value: ir.Value) -> np.dtype | None:
    try:
        return None if value.dtype is None else value.dtype.numpy()
    except Exception:
        return None


def _cast(c: np.ndarray, value: ir.Value) -> np.ndarray | None:
    dtype = _out_dtype(value)
    if dtype is None or dtype.kind not in _FILLABLE_KINDS:
        return None
    with np.errstate(all="ignore"):
        return np.asarray(c).astype(dtype).reshape(())


def transfer(node: ir.Node, ins: list[np.ndarray | None], *, assume_finite: bool) -> list[np.ndarray | None]:
    """Uniform scalars of ``node``'s outputs given those of its inputs (None = unknown)."""
    outs: list[np.ndarray | None] = [None] * len(node.outputs)
    if node.domain not in ("", "ai.onnx") or not node.outputs:
        return outs
    op = node.op_type
    first = node.outputs[0]
    with np.errstate(all="ignore"):
        result = _transfer_first(node, op, ins, assume_finite)
    if result is None:
        return outs
    if op == "Split":
        return [_cast(result, out) for out in node.outputs]
    outs[0] = _cast(result, first)
    return outs


def _transfer_first(node: ir.Node, op: str, ins: list[np.ndarray | None], assume_finite: bool) -> np.ndarray | None:
    def known(k: int) -> np.ndarray | None:
        return ins[k] if k < len(ins) else None

    if op in _UNARY:
        return None if known(0) is None else _UNARY[op](known(0))
    if op in _BINARY:
        a, b = known(0), known(1)
        # x * 0 -> 0 (NOTE: NaN/Inf * 0 is NaN; folded only under assume_finite, verification guards it)
        if op == "Mul" and assume_finite and (_is_zero(a) or _is_zero(b)):
            return np.zeros((), dtype=(a if a is not None else b).dtype)
        if op == "And" and (_is_zero(a) or _is_zero(b)):  # x and false -> false
            return np.asarray(False)
        if op == "Or" and ((a is not None and bool(a)) or (b is not None and bool(b))):  # x or true -> true
            return np.asarray(True)
        if a is None or b is None:
            return None
        return _BINARY[op](a, b)
    if op in _VARIADIC:
        if any(c is None for c in ins):
            return None
        acc = ins[0]
        for c in ins[1:]:
            acc = _VARIADIC[op](acc, c)
        return acc
    if op == "Mean":
        return None if any(c is None for c in ins) else np.mean(np.stack(ins))
    if op == "Where":
        cond, a, b = known(0), known(1), known(2)
        if cond is not None:
            return a if bool(cond) else b
        if a is not None and b is not None and a == b:
            return a
        return None
    if op in ("MatMul", "Gemm", "Conv", "MatMulInteger", "Einsum"):
        return _transfer_contraction(node, op, ins, assume_finite)
    if op in _DATA_MOVEMENT:
        return known(0)
    if op == "Concat":
        if ins and all(c is not None for c in ins) and all(c == ins[0] for c in ins):
            return ins[0]
        return None
    if op in ("ReduceSum", "CumSum"):  # a sum of zeros is zero
        return known(0) if _is_zero(known(0)) else None
    if op == "Pad":
        c, pad_value = known(0), known(2)
        mode = node.attributes.get_string("mode", "constant")
        if c is not None and mode == "constant" and (pad_value if pad_value is not None else 0) == c:
            return c
        return None
    if op == "ConstantOfShape":
        attr = node.attributes.get("value")
        return np.float32(0.0) if attr is None else np.asarray(attr.value.numpy()).reshape(-1)[0]
    return None


def _transfer_contraction(
    node: ir.Node, op: str, ins: list[np.ndarray | None], assume_finite: bool
) -> np.ndarray | None:
    if op == "Einsum":
        # Einsum is a sum of products: any all-zero operand makes it zero.
        if assume_finite and any(_is_zero(c) for c in ins):
            return np.zeros((), dtype=next(c for c in ins if c is not None).dtype)
        return None
    a = ins[0] if ins else None
    b = ins[1] if len(ins) > 1 else None
    bias = ins[2] if len(ins) > 2 else None
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    # MatMul(x, 0) / Gemm(x, 0) / Conv(x, W=0) -> 0 (NOTE: assumes x finite)
    if assume_finite and (_is_zero(a) or _is_zero(b)):
        zero = np.zeros((), dtype=(a if a is not None else b).dtype)
        if op == "MatMul" or not has_bias:
            return zero
        if bias is None:
            return None
        if op == "Gemm":
            return zero + node.attributes.get_float("beta", 1.0) * bias
        return zero + bias
    if op == "MatMul" and a is not None and b is not None:
        shape = node.inputs[0].shape
        if shape is not None and len(shape) >= 1 and isinstance(shape[-1], int):
            return a * b * shape[-1]
    return None
