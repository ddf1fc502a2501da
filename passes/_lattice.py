"""The uniform-value lattice: unknown · uniform(c) · constant (docs/architecture.md, the static passes).

A value is *uniform* when every element equals one scalar ``c``; its shape is the value's own
(inferred, possibly symbolic) shape. This module holds the transfer functions: given the uniform
scalars of a node's inputs (None = unknown), the uniform scalars of its outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._quantized import is_zero_weight, quantized_weight

__all__ = [
    "ABSORBING",
    "ELEMENTWISE_BINARY",
    "TRANSFERS",
    "UNARY",
    "UNARY_ATTR",
    "UNIFORM_META_KEY",
    "Absorbing",
    "is_true",
    "is_zero",
    "transfer",
    "uniform_of_constant",
]

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
    "Acos": np.arccos,
    "Asin": np.arcsin,
    "Atan": np.arctan,
    "Acosh": np.arccosh,
    "Asinh": np.arcsinh,
    "Atanh": np.arctanh,
    "Softsign": lambda x: x / (1 + np.abs(x)),
    "Mish": lambda x: x * np.tanh(np.log1p(np.exp(x))),
    "HardSwish": lambda x: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0),
    "BitwiseNot": np.invert,
}


def _gelu(node: ir.Node, x: np.ndarray) -> np.ndarray:
    x = np.float64(x)
    if node.attributes.get_string("approximate", "none") == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _f(node: ir.Node, name: str, default: float) -> float:
    return node.attributes.get_float(name, default)


def _shrink(node: ir.Node, x: np.ndarray) -> np.ndarray:
    bias, lambd = _f(node, "bias", 0.0), _f(node, "lambd", 0.5)
    return np.where(x > lambd, x - bias, np.where(x < -lambd, x + bias, 0.0 * x))


def _is_inf(node: ir.Node, x: np.ndarray) -> np.ndarray:
    positive = np.isposinf(x) & bool(node.attributes.get_int("detect_positive", 1))
    return positive | (np.isneginf(x) & bool(node.attributes.get_int("detect_negative", 1)))


# Activations whose value depends on attributes: (node, array) -> array, elementwise (scalars are
# uniforms, arrays are rows). Defaults are the spec's.
_UNARY_ATTR = {
    "Gelu": _gelu,
    "Elu": lambda n, x: np.where(x > 0, x, _f(n, "alpha", 1.0) * (np.exp(x) - 1.0)),
    "Selu": lambda n, x: (
        _f(n, "gamma", 1.05070102519989013671875)
        * np.where(x > 0, x, _f(n, "alpha", 1.67326319217681884765625) * (np.exp(x) - 1.0))
    ),
    "Celu": lambda n, x: (
        np.maximum(0.0, x) + np.minimum(0.0, _f(n, "alpha", 1.0) * (np.exp(x / _f(n, "alpha", 1.0)) - 1.0))
    ),
    "LeakyRelu": lambda n, x: np.where(x >= 0, x, _f(n, "alpha", 0.01) * x),
    "ThresholdedRelu": lambda n, x: np.where(x > _f(n, "alpha", 1.0), x, 0.0 * x),
    "HardSigmoid": lambda n, x: np.clip(_f(n, "alpha", 0.2) * x + _f(n, "beta", 0.5), 0.0, 1.0),
    "Shrink": _shrink,
    "IsNaN": lambda n, x: np.isnan(x),
    "IsInf": _is_inf,
}


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(np.true_divide(a, b)).astype(a.dtype)
    return np.true_divide(a, b)


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """ONNX Runtime's Pow: ``std::pow`` in double, cast to the base's type.

    numpy refuses integers to negative integer powers; ORT gives the truncated
    double (2 ** -1 -> 0). A result that does not fit the integer type (0 ** -1) is implementation
    defined in C++: we give up on it.
    """
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        info = np.iinfo(np.asarray(a).dtype)
        result = np.power(np.float64(a), np.float64(b))
        if (
            not np.all(np.isfinite(result))
            or np.any(np.trunc(result) < info.min)
            or np.any(np.trunc(result) > info.max)
        ):
            return None
        return np.asarray(np.trunc(result)).astype(np.asarray(a).dtype)
    return np.power(a, b)


_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _div,
    "Pow": _pow,
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

# Shared with the row-constant transfers (passes/_rows.py): elementwise, so they apply to arrays.
UNARY = _UNARY
UNARY_ATTR = _UNARY_ATTR
ELEMENTWISE_BINARY = {**_BINARY, **_VARIADIC}

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


def is_zero(c: np.ndarray | None) -> bool:
    """A uniform that is 0 (false)."""
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
    if not node.outputs:
        return outs
    op = node.op_type
    first = node.outputs[0]
    # Another domain's op has its row under "domain::op" (com.microsoft::MatMulNBits).
    rule = TRANSFERS.get(op if node.domain in ("", "ai.onnx") else f"{node.domain}::{op}")
    if rule is None:
        return outs
    with np.errstate(all="ignore"):
        result = rule(node, _Ins(ins), assume_finite)
    if result is None:
        return outs
    if op == "Split":
        return [_cast(result, out) for out in node.outputs]
    outs[0] = _cast(result, first)
    return outs


class _Ins(list):
    """The inputs' uniform scalars; ``at(k)`` is None past the end (an absent optional input)."""

    def at(self, k: int) -> np.ndarray | None:
        return self[k] if k < len(self) else None


def is_true(c: np.ndarray | None) -> bool:
    """A uniform that is nonzero (true)."""
    return c is not None and bool(c)


_is_zero, _is_true = is_zero, is_true  # their former private names, for rules written against those


@dataclasses.dataclass(frozen=True)
class Absorbing:
    """``op`` is ``value(c)`` whatever its other operand when operand ``operand`` is ``c`` with ``test(c)``.

    ``finite``: only under ``assume_finite`` (``NaN * 0`` is NaN; verification guards it)."""

    op: str
    operand: int
    test: Callable[[np.ndarray | None], bool]
    value: Callable[[np.ndarray], np.ndarray]
    finite: bool = False


def _both_orders(op: str, test: Callable, value: Callable, finite: bool = False) -> tuple[Absorbing, Absorbing]:
    """The rule with the absorbing operand second, then first (the op commutes)."""
    return Absorbing(op, 1, test, value, finite), Absorbing(op, 0, test, value, finite)


def _zero_like(c: np.ndarray) -> np.ndarray:
    return np.zeros((), dtype=c.dtype)


# One row per rule: an operand that decides the result alone. Checked before the operands' own transfer.
ABSORBING: tuple[Absorbing, ...] = (
    *_both_orders("Mul", is_zero, _zero_like, finite=True),  # x * 0 -> 0, 0 * x -> 0
    *_both_orders("And", is_zero, lambda c: np.asarray(False)),  # x and false -> false, false and x -> false
    *_both_orders("Or", is_true, lambda c: np.asarray(True)),  # x or true -> true, true or x -> true
)
_ABSORBING_BY_OP: dict[str, tuple[Absorbing, ...]] = {}
for _rule in ABSORBING:
    _ABSORBING_BY_OP[_rule.op] = (*_ABSORBING_BY_OP.get(_rule.op, ()), _rule)


def _binary(op: str) -> Transfer:
    def rule(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
        a, b = ins.at(0), ins.at(1)
        for absorbing in _ABSORBING_BY_OP.get(op, ()):
            c = (a, b)[absorbing.operand]
            if (assume_finite or not absorbing.finite) and absorbing.test(c):
                return absorbing.value(c)  # type: ignore[arg-type]
        if a is None or b is None:
            return None
        return _BINARY[op](a, b)

    return rule


def _variadic(op: str) -> Transfer:
    def rule(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
        if any(c is None for c in ins):
            return None
        acc = ins[0]
        for c in ins[1:]:
            acc = _VARIADIC[op](acc, c)
        return acc

    return rule


def _unary(op: str) -> Transfer:
    return lambda node, ins, assume_finite: None if ins.at(0) is None else _UNARY[op](ins.at(0))


def _unary_attr(op: str) -> Transfer:
    return lambda node, ins, assume_finite: None if ins.at(0) is None else np.asarray(_UNARY_ATTR[op](node, ins.at(0)))


def _contraction(op: str) -> Transfer:
    return lambda node, ins, assume_finite: _transfer_contraction(node, op, ins, assume_finite)


def _mean(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    return None if any(c is None for c in ins) else np.mean(np.stack(ins))


def _where(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    cond, a, b = ins.at(0), ins.at(1), ins.at(2)
    if cond is not None:
        return a if bool(cond) else b
    if a is not None and b is not None and a == b:
        return a
    return None


def _concat(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    if ins and all(c is not None for c in ins) and all(c == ins[0] for c in ins):
        return ins[0]
    return None


def _sum_of_zeros(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    return ins.at(0) if is_zero(ins.at(0)) else None


def _pad(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    c = ins.at(0)
    mode = node.attributes.get_string("mode", "constant")
    if c is None:
        return None
    if mode != "constant":  # edge / reflect / wrap copy elements of the uniform input
        return c
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        # NOTE: a run-time constant_value (computed, or an overridable initializer) is unknown, never 0.
        pad_value = ins.at(2)
    else:
        pad_value = node.attributes.get("value").value if "value" in node.attributes else 0
    return c if pad_value is not None and pad_value == c else None


def _constant_of_shape(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    attr = node.attributes.get("value")
    return np.float32(0.0) if attr is None else np.asarray(attr.value.numpy()).reshape(-1)[0]


def _first(node: ir.Node, ins: _Ins, assume_finite: bool) -> np.ndarray | None:
    return ins.at(0)


# (node, the inputs' uniform scalars, assume_finite) -> the first output's uniform scalar, or None.
Transfer = Callable[[ir.Node, _Ins, bool], "np.ndarray | None"]

# The transfer function of each op: one row per op (or per family of ops sharing one). An op's rule is a row here.
TRANSFERS: dict[str, Transfer] = {
    **{op: _unary(op) for op in _UNARY},  # f(uniform c) -> uniform f(c)
    **{op: _unary_attr(op) for op in _UNARY_ATTR},  # f_attrs(uniform c) -> uniform f_attrs(c)
    "Clip": lambda node, ins, assume_finite: _clip(node, ins),  # Clip(c, lo, hi) -> min(max(c, lo), hi)
    "Softmax": lambda node, ins, assume_finite: _softmax(node, "Softmax", ins.at(0)),  # Softmax(c) -> 1/n
    "LogSoftmax": lambda node, ins, assume_finite: _softmax(node, "LogSoftmax", ins.at(0)),  # LogSoftmax(c) -> -log n
    **{op: _binary(op) for op in _BINARY},  # a op b -> uniform (a op b); ABSORBING first
    **{op: _variadic(op) for op in _VARIADIC},  # Sum / Max / Min(c1, c2, ...) -> the fold of the c's
    "Mean": _mean,  # Mean(c1, ..., cn) -> their mean
    "Where": _where,  # Where(c, a, b) -> a or b; Where(x, c, c) -> c
    "MatMulInteger": lambda node, ins, assume_finite: _matmul_integer(node, ins),  # (a-azp)(b-bzp) K
    # MatMul / Gemm / Conv / Einsum with a zero operand -> 0 (+ bias); MatMul(a, b) -> a b K
    **{op: _contraction(op) for op in ("MatMul", "Gemm", "Conv", "Einsum")},
    **{op: _first for op in _DATA_MOVEMENT},  # Reshape / Slice / ReduceMax / ...(uniform c) -> c
    "Concat": _concat,  # Concat(c, c, ...) -> c
    "ReduceSum": _sum_of_zeros,  # ReduceSum(0) -> 0
    "CumSum": _sum_of_zeros,  # CumSum(0) -> 0
    "Pad": _pad,  # Pad(c) with c (or edge / reflect) -> c
    "ConstantOfShape": _constant_of_shape,  # ConstantOfShape(value=c) -> c
    "DequantizeLinear": lambda node, ins, assume_finite: _dequantize(node, ins),  # a zero weight -> 0
    # MatMulNBits(x, W) with W all zero by its blocks (passes/_quantized.py), or x = 0 -> 0 (+ bias)
    "com.microsoft::MatMulNBits": lambda node, ins, assume_finite: _matmul_nbits(node, ins, assume_finite),
}


def _clip(node: ir.Node, ins: list[np.ndarray | None]) -> np.ndarray | None:
    """Clip(c, lo, hi): the bounds are inputs (opset 11+, each optional) or attributes (older)."""
    c = ins[0] if ins else None
    if c is None:
        return None
    bounds: list[np.ndarray | float | None] = []
    for k, name in ((1, "min"), (2, "max")):
        if k < len(node.inputs) and node.inputs[k] is not None:
            if ins[k] is None:
                return None  # a run-time bound
            bounds.append(ins[k])
        else:
            bounds.append(node.attributes.get_float(name, None) if name in node.attributes else None)
    lo, hi = bounds
    result = np.asarray(c)
    if lo is not None:
        result = np.maximum(result, np.asarray(lo).astype(result.dtype))
    if hi is not None:
        result = np.minimum(result, np.asarray(hi).astype(result.dtype))
    return result


def _softmax(node: ir.Node, op: str, c: np.ndarray | None) -> np.ndarray | None:
    """Softmax of a uniform is 1/n (LogSoftmax: -log n), n the static size of the axis."""
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    if c is None or shape is None or len(shape) == 0 or not np.isfinite(c):
        return None
    axis = node.attributes.get_int("axis", -1) % len(shape)
    if axis != len(shape) - 1:
        return None  # before opset 13 the axes from `axis` on are flattened: only the last agrees
    n = shape[axis]
    if not isinstance(n, int) or n <= 0:
        return None
    return np.asarray(-math.log(n) if op == "LogSoftmax" else 1.0 / n, dtype=np.float64)


def _matmul_integer(node: ir.Node, ins: list[np.ndarray | None]) -> np.ndarray | None:
    """MatMulInteger(a, b, a_zero_point, b_zero_point) = sum_k (a - azp)(b - bzp): a zero point is no bias.

    Zero when either centred operand is zero (a uniform equal to its zero point); (ca - azp)(cb - bzp) K
    when both are uniform and K is static. Integers: no finiteness hazard.
    """
    centred = []
    for k in (0, 1):
        c = ins[k] if k < len(ins) else None
        has_zp = len(node.inputs) > k + 2 and node.inputs[k + 2] is not None
        zp = ins[k + 2] if has_zp and len(ins) > k + 2 else None
        if c is None or (has_zp and zp is None):
            centred.append(None)
            continue
        centred.append(np.int64(c) - np.int64(0 if zp is None else zp))
    if any(c is not None and c == 0 for c in centred):
        return np.zeros((), dtype=np.int32)
    shape = node.inputs[0].shape
    if None in centred or shape is None or len(shape) < 1 or not isinstance(shape[-1], int):
        return None
    total = int(centred[0]) * int(centred[1]) * shape[-1]
    return np.asarray(total, dtype=np.int32) if -(2**31) <= total < 2**31 else None


def _transfer_contraction(
    node: ir.Node, op: str, ins: list[np.ndarray | None], assume_finite: bool
) -> np.ndarray | None:
    if op == "Einsum":
        # Einsum is a sum of products: any all-zero operand makes it zero.
        if assume_finite and any(is_zero(c) for c in ins):
            return np.zeros((), dtype=next(c for c in ins if c is not None).dtype)
        return None
    a = ins[0] if ins else None
    b = ins[1] if len(ins) > 1 else None
    bias = ins[2] if len(ins) > 2 else None
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    # MatMul(x, 0) / Gemm(x, 0) / Conv(x, W=0) -> 0 (NOTE: assumes x finite)
    if assume_finite and (is_zero(a) or is_zero(b)):
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


def _dequantize(node: ir.Node, ins: list[np.ndarray | None]) -> np.ndarray | None:
    """DequantizeLinear(x, scale, zero_point): (x - zp) * scale of uniform operands; 0 for a constant weight
    whose every block is zero (codes equal to the zero point, or a zero scale), read by passes/_quantized.py."""
    x, scale = (ins[k] if k < len(ins) else None for k in (0, 1))
    has_zp = len(node.inputs) > 2 and node.inputs[2] is not None
    zp = ins[2] if has_zp and len(ins) > 2 else (np.int64(0) if not has_zp else None)
    if x is not None and scale is not None and zp is not None and np.isfinite(scale):
        return np.float32((np.int64(x) - np.int64(zp)) * np.float32(scale))
    if is_zero_weight(node):
        weight = quantized_weight(node)
        return None if weight is None else np.zeros((), dtype=weight.out_dtype)
    return None


def _matmul_nbits(node: ir.Node, ins: list[np.ndarray | None], assume_finite: bool) -> np.ndarray | None:
    """MatMulNBits(A, B, scales, zero_points, g_idx, bias): zero when the weight is (NOTE: assumes A finite, as
    MatMul's rule) or A is uniform 0; plus the bias, when it has one and it is uniform."""
    if not assume_finite:
        return None
    a = ins[0] if ins else None
    if not _is_zero(a) and not is_zero_weight(node):
        return None
    if len(node.inputs) > 5 and node.inputs[5] is not None:
        bias = ins[5] if len(ins) > 5 else None
        return None if bias is None else np.asarray(bias)
    return np.zeros((), dtype=np.float32)
