"""Seeded random ONNX graphs over the standard ops exports use, for the differential fuzzer.

A graph has 1–3 float inputs with symbolic leading dims (``N``, ``S``) or static ones, 5–40 nodes drawn from
~70 ops (elementwise, activations, MatMul/Gemm, shape ops, reductions, comparisons and Where, Cast,
Shape/ConstantOfShape, Pad, Softmax, LayerNormalization, If with a constant or a run-time condition, ...),
constants that are often all-zero, all-one, uniform or have zero rows, an opset in 17–20, value_info present
or absent, and 1–3 outputs (sometimes one value listed twice). Shapes are tracked symbolically so that most
graphs are valid; the harness counts (and skips) the ones that are not.

Versions (``generate(seed, version)``; a seed's graph never changes within a version, so a reported seed replays):
1. the ops above;
2. (the default) also ``If`` nodes whose branches read outer values: shape chains of outer values inside a branch
   (``Shape``/``Gather``/``Concat``/``Reshape``/``Expand``, ``ConstantOfShape``, uniforms and zero-weight rows made
   there, a nested ``If``), and outer ``Reshape``/``Expand`` fed by the shape of a branch output.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["VERSION", "Generated", "Val", "generate"]

# The generator version a plain ``generate(seed)`` draws from (module docstring).
VERSION = 2

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL

Dim = int | str


@dataclasses.dataclass(frozen=True)
class Val:
    name: str
    dtype: int  # TensorProto elem type
    shape: tuple[Dim, ...]


@dataclasses.dataclass
class Generated:
    model: onnx.ModelProto
    seed: int


def _np(dtype: int) -> type:
    return helper.tensor_dtype_to_np_dtype(dtype)


class _Builder:
    def __init__(self, rng: np.random.Generator, opset: int) -> None:
        self.rng = rng
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, seq: list):
        return seq[int(self.rng.integers(len(seq)))]

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def fconst(self, shape: tuple[int, ...], dtype: int = FLOAT, nonzero: bool = False) -> np.ndarray:
        """Often all-zero, all-one, uniform or with zero rows; sometimes random."""
        kinds = ["ones", "uniform", "random"] if nonzero else ["zeros", "zeros", "ones", "uniform", "rows", "random"]
        kind = self.pick(kinds)
        if kind == "zeros":
            a = np.zeros(shape)
        elif kind == "ones":
            a = np.ones(shape)
        elif kind == "uniform":
            a = np.full(shape, self.pick([-1.0, 0.5, 2.0, -0.25, 3.0]))
        else:
            a = self.rng.uniform(0.5, 1.5, size=shape) * self.rng.choice([-1.0, 1.0], size=shape)
            if kind == "rows" and len(shape) >= 1 and shape[0] > 0:
                a[self.rng.random(shape[0]) < 0.5] = 0.0
            elif kind == "random" and not nonzero:
                a = np.where(self.rng.random(shape) < 0.2, 0.0, a)
        return np.asarray(a).astype(_np(dtype))

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, **attrs))
        return outs

    def op(self, op: str, inputs: list[str], **attrs) -> str:
        return self.node(op, inputs, **attrs)[0]

    def i64(self, values: list[int] | int) -> str:
        return self.const(np.array(values, dtype=np.int64), "k")


def _broadcast(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + a
    b = (1,) * (rank - len(b)) + b
    out: list[Dim] = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


def _static(shape: tuple[Dim, ...]) -> bool:
    return all(isinstance(d, int) for d in shape)


# ---------------------------------------------------------------------------------------------- op makers
# Each takes (builder, pool) and returns the new values (or [] when it does not apply).

UNARY = [
    "Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Exp", "Log", "Sqrt", "Sin", "Cos", "Erf", "Softplus", "Softsign",
    "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Mish", "Floor", "Ceil",
    "Round", "Sign", "Reciprocal", "Identity", "Gelu",
]  # fmt: skip
BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu", "Sum", "Mean", "Mod"]
COMPARE = ["Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"]


def _floats(pool: list[Val]) -> list[Val]:
    return [v for v in pool if v.dtype == FLOAT]


def op_unary(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    op = b.pick(UNARY)
    if op == "Gelu" and b.opset < 20:
        op = "Erf"
    if op == "Mish" and b.opset < 18:
        op = "Softplus"
    src = x.name
    if op in ("Log", "Sqrt", "Reciprocal"):
        # Keep the domain: |x| + 1 (a run-time value stays run-time).
        src = b.op("Add", [b.op("Abs", [src]), b.const(np.array(1.0, np.float32))])
    if op == "Exp":
        src = b.op("Tanh", [src])
    return [Val(b.op(op, [src]), FLOAT, x.shape)]


def op_clip(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    lo = b.const(np.array(b.pick([-1.0, 0.0, -0.5]), np.float32)) if b.chance(0.7) else ""
    hi = b.const(np.array(b.pick([1.0, 0.0, 2.0]), np.float32)) if b.chance(0.7) else ""
    inputs = [x.name, lo, hi]
    while inputs and inputs[-1] == "":
        inputs.pop()
    return [Val(b.op("Clip", inputs), FLOAT, x.shape)]


def _operand(b: _Builder, pool: list[Val], x: Val) -> tuple[str, tuple[Dim, ...]]:
    """The other operand of a binary op with ``x``: another value of a broadcastable shape, or a constant."""
    others = [v for v in _floats(pool) if _broadcast(x.shape, v.shape) is not None]
    if others and b.chance(0.4):
        v = b.pick(others)
        return v.name, v.shape
    last = x.shape[-1] if x.shape and isinstance(x.shape[-1], int) else 1
    shape = b.pick([(), (1,), (last,), (1, last)] + ([tuple(x.shape)] if _static(x.shape) else []))
    return b.const(b.fconst(shape)), shape


def op_binary(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    op = b.pick(BINARY)
    if op == "Div":
        last = x.shape[-1] if x.shape and isinstance(x.shape[-1], int) else 1
        shape = b.pick([(), (last,)])
        return [Val(b.op("Div", [x.name, b.const(b.fconst(shape, nonzero=True))]), FLOAT, _broadcast(x.shape, shape))]
    if op == "Pow":
        e = b.pick([0.0, 1.0, 2.0, 3.0, 0.5])
        src = x.name if e in (0.0, 1.0, 2.0, 3.0) else b.op("Abs", [x.name])
        return [Val(b.op("Pow", [src, b.const(np.array(e, np.float32))]), FLOAT, x.shape)]
    if op == "Mod":
        return [Val(b.op("Mod", [x.name, b.const(b.fconst((), nonzero=True))], fmod=1), FLOAT, x.shape)]
    if op == "PRelu":
        last = x.shape[-1] if x.shape and isinstance(x.shape[-1], int) else 1
        slope = b.const(b.fconst(b.pick([(1,), (last,)])))
        return [Val(b.op("PRelu", [x.name, slope]), FLOAT, x.shape)]
    other, shape = _operand(b, pool, x)
    out = _broadcast(x.shape, shape)
    operands = [x.name, other] if b.chance(0.5) else [other, x.name]
    return [Val(b.op(op, operands), FLOAT, out)]


def op_compare_where(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    other, shape = _operand(b, pool, x)
    cond = b.op(b.pick(COMPARE), [x.name, other])
    cshape = _broadcast(x.shape, shape)
    if b.chance(0.3):
        cond2 = b.op("Greater", [x.name, b.const(np.array(b.pick([0.0, 0.5]), np.float32))])
        cond = b.op(b.pick(["And", "Or", "Xor"]), [cond, cond2])
    if b.chance(0.2):
        cond = b.op("Not", [cond])
    if b.chance(0.2):
        return [Val(b.op("Cast", [cond], to=FLOAT), FLOAT, cshape)]
    y, yshape = _operand(b, pool, x)
    out = _broadcast(cshape, yshape)
    if out is None:
        return []
    return [Val(b.op("Where", [cond, x.name, y] if b.chance(0.5) else [cond, y, x.name]), FLOAT, out)]


def op_cast(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    kind = b.pick(["int", "double", "bool", "like", "half"])
    if kind == "int":
        mid = b.op("Cast", [b.op("Round", [x.name])], to=INT64)
    elif kind == "double":
        mid = b.op("Cast", [x.name], to=TensorProto.DOUBLE)
        if b.chance(0.5):
            mid = b.op("Mul", [mid, b.const(b.fconst((), TensorProto.DOUBLE))])
    elif kind == "half":
        clipped = b.op("Clip", [x.name, b.const(np.float32(-8)), b.const(np.float32(8))])
        mid = b.op("Cast", [clipped], to=TensorProto.FLOAT16)
    elif kind == "bool":
        mid = b.op("Cast", [x.name], to=BOOL)
    else:
        return [Val(b.op("CastLike", [x.name, b.const(np.array([1.0], np.float32))]), FLOAT, x.shape)]
    return [Val(b.op("Cast", [mid], to=FLOAT), FLOAT, x.shape)]


def op_matmul(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if len(v.shape) >= 1 and isinstance(v.shape[-1], int)]
    if not cands:
        return []
    x = b.pick(cands)
    k = x.shape[-1]
    m = b.pick([1, 2, 4, k])
    if b.chance(0.3) and len(x.shape) == 2:
        w = b.fconst((m, k))
        bias = b.const(b.fconst(b.pick([(m,), (1, m), ()]))) if b.chance(0.6) else None
        inputs = [x.name, b.const(w, "w")] + ([bias] if bias else [])
        return [Val(b.op("Gemm", inputs, transB=1, alpha=float(b.pick([1.0, 0.5]))), FLOAT, (x.shape[0], m))]
    w = b.const(b.fconst((k, m)), "w")
    out = b.op("MatMul", [x.name, w])
    if b.chance(0.4):
        out = b.op("Add", [out, b.const(b.fconst((m,)), "bias")])
    return [Val(out, FLOAT, (*x.shape[:-1], m))]


def op_reshape(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    if not x.shape:
        return [Val(b.op("Reshape", [x.name, b.i64([1, 1])]), FLOAT, (1, 1))]
    if _static(x.shape) and b.chance(0.5):
        total = int(np.prod(x.shape))
        return [Val(b.op("Reshape", [x.name, b.i64([-1])]), FLOAT, (total,))]
    # [.., a, b] -> [.., a*b] when both static
    if len(x.shape) >= 2 and b.chance(0.5) and isinstance(x.shape[-1], int) and isinstance(x.shape[-2], int):
        shape = [0] * (len(x.shape) - 2) + [x.shape[-2] * x.shape[-1]]
        out = (*x.shape[:-2], x.shape[-2] * x.shape[-1])
        return [Val(b.op("Reshape", [x.name, b.i64(shape)]), FLOAT, out)]
    # add a unit axis in the middle: [0, ..., 1, -1]
    if isinstance(x.shape[-1], int):
        shape = [0] * (len(x.shape) - 1) + [1, -1]
        return [Val(b.op("Reshape", [x.name, b.i64(shape)]), FLOAT, (*x.shape[:-1], 1, x.shape[-1]))]
    return []


def op_transpose(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if len(v.shape) >= 2]
    if not cands:
        return []
    x = b.pick(cands)
    perm = [int(i) for i in b.rng.permutation(len(x.shape))]
    if b.chance(0.2):
        perm = list(range(len(x.shape)))  # identity permutation
    return [Val(b.op("Transpose", [x.name], perm=perm), FLOAT, tuple(x.shape[i] for i in perm))]


def op_slice(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if any(isinstance(d, int) and d >= 2 for d in v.shape)]
    if not cands:
        return []
    x = b.pick(cands)
    axes = [i for i, d in enumerate(x.shape) if isinstance(d, int) and d >= 2]
    axis = b.pick(axes)
    n = x.shape[axis]
    start = int(b.rng.integers(0, n - 1))
    end = b.pick([int(b.rng.integers(start + 1, n + 1)), 2**62])
    step = 1
    length = min(end, n) - start
    shape = list(x.shape)
    shape[axis] = length
    inputs = [x.name, b.i64([start]), b.i64([end]), b.i64([axis - len(x.shape) if b.chance(0.5) else axis])]
    if b.chance(0.3):
        inputs.append(b.i64([step]))
    return [Val(b.op("Slice", inputs), FLOAT, tuple(shape))]


def op_gather(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if any(isinstance(d, int) and d >= 1 for d in v.shape)]
    if not cands:
        return []
    x = b.pick(cands)
    axes = [i for i, d in enumerate(x.shape) if isinstance(d, int) and d >= 1]
    axis = b.pick(axes)
    n = x.shape[axis]
    if b.chance(0.4):
        idx = np.array(int(b.rng.integers(-n, n)), np.int64)
    else:
        idx = b.rng.integers(-n, n, size=int(b.rng.integers(1, 4))).astype(np.int64)
    shape = x.shape[:axis] + tuple(idx.shape) + x.shape[axis + 1 :]
    return [Val(b.op("Gather", [x.name, b.const(idx, "idx")], axis=axis), FLOAT, shape)]


def op_concat(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick([v for v in _floats(pool) if v.shape])
    axis = len(x.shape) - 1 if isinstance(x.shape[-1], int) else 0
    same = [v for v in _floats(pool) if len(v.shape) == len(x.shape) and all(
        i == axis or d == e for i, (d, e) in enumerate(zip(v.shape, x.shape)))]  # fmt: skip
    parts = [x] + [b.pick(same) for _ in range(int(b.rng.integers(0, 2)))]
    names = [p.name for p in parts]
    if _static(x.shape) and b.chance(0.5):
        cshape = list(x.shape)
        cshape[axis] = b.pick([1, 2])
        names.insert(int(b.rng.integers(len(names) + 1)), b.const(b.fconst(tuple(cshape))))
        parts.append(Val("", FLOAT, tuple(cshape)))
    total: Dim = 0
    for p in parts:
        d = p.shape[axis]
        if not isinstance(d, int) or not isinstance(total, int):
            total = "?"
        else:
            total += d
    if total == "?":
        return []
    shape = list(x.shape)
    shape[axis] = total
    return [Val(b.op("Concat", names, axis=axis), FLOAT, tuple(shape))]


def op_split(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if v.shape and isinstance(v.shape[-1], int) and v.shape[-1] >= 2]
    if not cands:
        return []
    x = b.pick(cands)
    n = x.shape[-1]
    first = int(b.rng.integers(1, n))
    outs = b.node("Split", [x.name, b.i64([first, n - first])], n_out=2, axis=-1)
    return [Val(outs[0], FLOAT, (*x.shape[:-1], first)), Val(outs[1], FLOAT, (*x.shape[:-1], n - first))]


def op_unsqueeze(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick([v for v in _floats(pool) if len(v.shape) <= 3])
    axis = int(b.rng.integers(0, len(x.shape) + 1))
    shape = list(x.shape)
    shape.insert(axis, 1)
    u = b.op("Unsqueeze", [x.name, b.i64([axis])])
    if b.chance(0.5):
        return [Val(b.op("Squeeze", [u, b.i64([axis])]), FLOAT, x.shape)]
    return [Val(u, FLOAT, tuple(shape))]


def op_squeeze(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if 1 in v.shape]
    if not cands:
        return []
    x = b.pick(cands)
    axis = x.shape.index(1)
    return [Val(b.op("Squeeze", [x.name, b.i64([axis])]), FLOAT, x.shape[:axis] + x.shape[axis + 1 :])]


def op_expand(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick([v for v in _floats(pool) if len(v.shape) <= 3])
    if _static(x.shape) and b.chance(0.5):
        target = (2, *[d if d != 1 else 3 for d in x.shape])
        return [Val(b.op("Expand", [x.name, b.i64(list(target))]), FLOAT, tuple(target))]
    # Expand to the shape of another value (a run-time shape).
    others = [v for v in _floats(pool) if _broadcast(x.shape, v.shape) is not None]
    y = b.pick(others)
    return [Val(b.op("Expand", [x.name, b.op("Shape", [y.name])]), FLOAT, _broadcast(x.shape, y.shape))]


def op_flatten_tile(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    if b.chance(0.5) and _static(x.shape) and x.shape:
        axis = int(b.rng.integers(0, len(x.shape) + 1))
        a = int(np.prod(x.shape[:axis])) if axis else 1
        return [Val(b.op("Flatten", [x.name], axis=axis), FLOAT, (a, int(np.prod(x.shape[axis:]))))]
    if not x.shape:
        return []
    reps = [1] * (len(x.shape) - 1) + [2]
    last = x.shape[-1]
    if not isinstance(last, int):
        return []
    return [Val(b.op("Tile", [x.name, b.i64(reps)]), FLOAT, (*x.shape[:-1], last * 2))]


REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare"]


def op_reduce(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if v.shape]
    if not cands:
        return []
    x = b.pick(cands)
    op = b.pick(REDUCE)
    axis = int(b.rng.integers(0, len(x.shape)))
    keep = int(b.chance(0.6))
    shape = list(x.shape)
    if keep:
        shape[axis] = 1
    else:
        shape.pop(axis)
    src = x.name
    if op == "ReduceProd":
        src = b.op("Tanh", [src])
    if op == "ReduceSum" or b.opset >= 18:
        out = b.op(op, [src, b.i64([axis])], keepdims=keep)
    else:
        out = b.op(op, [src], axes=[axis], keepdims=keep)
    return [Val(out, FLOAT, tuple(shape))]


def op_argmax_cumsum(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if v.shape]
    if not cands:
        return []
    x = b.pick(cands)
    axis = int(b.rng.integers(0, len(x.shape)))
    if b.chance(0.5):
        shape = list(x.shape)
        shape[axis] = 1
        idx = b.op(b.pick(["ArgMax", "ArgMin"]), [x.name], axis=axis, keepdims=1)
        return [Val(b.op("Cast", [idx], to=FLOAT), FLOAT, tuple(shape))]
    return [Val(b.op("CumSum", [x.name, b.i64(axis)]), FLOAT, x.shape)]


def op_norm(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if v.shape and isinstance(v.shape[-1], int)]
    if not cands:
        return []
    x = b.pick(cands)
    kind = b.pick(["Softmax", "LogSoftmax", "LayerNormalization", "LpNormalization"])
    if kind == "LayerNormalization":
        d = x.shape[-1]
        inputs = [x.name, b.const(b.fconst((d,))), b.const(b.fconst((d,)))][: 3 if b.chance(0.6) else 2]
        return [Val(b.op(kind, inputs, axis=-1, epsilon=1e-5), FLOAT, x.shape)]
    if kind == "LpNormalization":
        return [Val(b.op(kind, [x.name], axis=-1, p=b.pick([1, 2])), FLOAT, x.shape)]
    return [Val(b.op(kind, [x.name], axis=-1), FLOAT, x.shape)]


def op_shape_ops(b: _Builder, pool: list[Val]) -> list[Val]:
    """Shape → ConstantOfShape (float or int64), sometimes through integer arithmetic, back to float."""
    x = b.pick(_floats(pool))
    shape = b.op("Shape", [x.name])
    if b.chance(0.5):
        value = b.pick([0.0, 1.0, 2.0, -1.0])
        filled = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([value], np.float32)))
        return [Val(filled, FLOAT, x.shape)]
    ivalue = b.pick([0, 1, 2, 3])
    c = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([ivalue], np.int64)))
    op = b.pick(["Pow", "Mul", "Add", "Sub", "none"])
    if op == "Pow":
        c = b.op("Pow", [c, b.const(np.array(b.pick([-1, 0, 1, 2]), np.int64))])
    elif op != "none":
        c = b.op(op, [c, b.const(np.array(b.pick([0, 1, 3]), np.int64))])
    out = b.op("Cast", [c], to=FLOAT)
    if b.chance(0.5):
        out = b.op("Mul", [out, x.name])
    if b.chance(0.3):
        size = b.op("Cast", [b.op("Size", [x.name])], to=FLOAT)
        out = b.op("Add", [out, size])
    return [Val(out, FLOAT, x.shape)]


def op_pad(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if v.shape and isinstance(v.shape[-1], int)]
    if not cands:
        return []
    x = b.pick(cands)
    r = len(x.shape)
    lo, hi = int(b.rng.integers(0, 2)), int(b.rng.integers(0, 3))
    pads = [0] * r + [0] * r
    pads[r - 1], pads[2 * r - 1] = lo, hi
    inputs = [x.name, b.i64(pads)]
    if b.chance(0.2):  # a run-time constant_value
        inputs.append(b.op("ReduceMax", [x.name], keepdims=0))
    elif b.chance(0.6):
        inputs.append(b.const(np.array(b.pick([0.0, 1.0, -2.0]), np.float32)))
    mode = b.pick(["constant", "constant", "reflect", "edge"])
    if mode == "reflect" and x.shape[-1] <= max(lo, hi):
        mode = "edge"
    if mode != "constant":
        inputs = inputs[:2]
    return [Val(b.op("Pad", inputs, mode=mode), FLOAT, (*x.shape[:-1], x.shape[-1] + lo + hi))]


def op_matmul_integer(b: _Builder, pool: list[Val]) -> list[Val]:
    """uint8 MatMulInteger with zero points (constant, often zero, or computed), back to float."""
    cands = [v for v in _floats(pool) if len(v.shape) >= 1 and isinstance(v.shape[-1], int)]
    if not cands:
        return []
    x = b.pick(cands)
    k, m = x.shape[-1], b.pick([1, 3])
    clipped = b.op("Clip", [b.op("Round", [x.name]), b.const(np.float32(0)), b.const(np.float32(5))])
    a = b.op("Cast", [clipped], to=TensorProto.UINT8)
    w = b.const(b.pick([np.zeros((k, m)), np.ones((k, m)), b.rng.integers(0, 4, size=(k, m))]).astype(np.uint8))
    inputs = [a, w]
    if b.chance(0.7):
        inputs.append(b.const(np.array(b.pick([0, 1, 2]), np.uint8)))
        if b.chance(0.6):
            inputs.append(b.const(np.array(b.pick([0, 1, 3]), np.uint8)))
    out = b.op("MatMulInteger", inputs)
    return [Val(b.op("Cast", [out], to=FLOAT), FLOAT, (*x.shape[:-1], m))]


def op_trilu(b: _Builder, pool: list[Val]) -> list[Val]:
    cands = [v for v in _floats(pool) if len(v.shape) >= 2]
    if not cands:
        return []
    x = b.pick(cands)
    return [Val(b.op("Trilu", [x.name, b.i64(int(b.rng.integers(-1, 2)))], upper=int(b.chance(0.5))), FLOAT, x.shape)]


def _branch(b: _Builder, x: Val, name: str) -> onnx.GraphProto:
    op = b.pick(["Relu", "Neg", "Sigmoid", "Identity", "Tanh", "Mul0", "Add"])
    out = b.fresh(f"{name}_out")
    nodes = []
    inits = []
    if op == "Mul0":
        c = b.fresh("bc")
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), c))
        nodes.append(helper.make_node("Mul", [x.name, c], [out]))
    elif op == "Add":
        c = b.fresh("bc")
        inits.append(numpy_helper.from_array(np.array(1.0, np.float32), c))
        nodes.append(helper.make_node("Add", [x.name, c], [out]))
    else:
        nodes.append(helper.make_node(op, [x.name], [out]))
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, FLOAT, list(x.shape))], inits)


def op_if(b: _Builder, pool: list[Val]) -> list[Val]:
    x = b.pick(_floats(pool))
    if b.chance(0.5):
        cond = b.const(np.array(b.chance(0.5)), "cond")
    else:
        s = b.op("ReduceSum", [x.name], keepdims=0)
        cond = b.op(b.pick(["Greater", "Less"]), [s, b.const(np.array(b.pick([0.0, 1.0]), np.float32))])
    out = b.op("If", [cond], then_branch=_branch(b, x, b.fresh("then")), else_branch=_branch(b, x, b.fresh("else")))
    return [Val(out, FLOAT, x.shape)]


def _cond(b: _Builder, x: Val) -> str:
    if b.chance(0.5):
        return b.const(np.array(b.chance(0.5)), "cond")
    s = b.op("ReduceSum", [x.name], keepdims=0)
    return b.op(b.pick(["Greater", "Less"]), [s, b.const(np.array(b.pick([0.0, 1.0]), np.float32))])


def _shape_of(b: _Builder, x: Val) -> str:
    """``Shape(x)``, sometimes rebuilt from its dims: ``Concat(Gather(Shape(x), [i]), ...)`` or of two slices."""
    shape = b.op("Shape", [x.name])
    rank = len(x.shape)
    if rank == 0 or b.chance(0.4):
        return shape
    if b.chance(0.5):
        pieces = [b.op("Gather", [shape, b.i64([i])], axis=0) for i in range(rank)]
    else:
        cut = int(b.rng.integers(0, rank + 1))
        pieces = [b.op("Slice", [shape, b.i64([0]), b.i64([cut])]), b.op("Slice", [shape, b.i64([cut]), b.i64([rank])])]
    return b.op("Concat", pieces, axis=0)


def _scoped_step(b: _Builder, pool: list[Val], cur: Val, depth: int) -> Val:
    """One step inside a branch that keeps ``cur``'s shape, reading ``cur`` or other outer values."""
    kinds = ["unary", "reshape", "expand", "fill", "mul0", "outer", "row", "outer_shape"]
    if depth == 0:
        kinds.append("nested")
    kind = b.pick(kinds)
    same = [v for v in _floats(pool) if v.shape == cur.shape]
    if kind == "unary":
        return Val(b.op(b.pick(["Relu", "Neg", "Tanh", "Identity"]), [cur.name]), FLOAT, cur.shape)
    if kind == "reshape":  # flatten, then back through the (rebuilt) shape of an outer value of that shape
        flat = b.op("Reshape", [cur.name, b.i64([-1])])
        return Val(b.op("Reshape", [flat, _shape_of(b, b.pick(same))]), FLOAT, cur.shape)
    if kind == "expand":  # a constant (often uniform) expanded to an outer value's run-time shape
        last = cur.shape[-1] if cur.shape and isinstance(cur.shape[-1], int) else 1
        c = b.const(b.fconst(b.pick([(), (1,), (last,)])))
        e = b.op("Expand", [c, _shape_of(b, b.pick(same))])
        return Val(b.op(b.pick(["Add", "Mul", "Sub"]), [cur.name, e]), FLOAT, cur.shape)
    if kind == "fill":
        value = numpy_helper.from_array(np.array([b.pick([0.0, 1.0, 2.0])], np.float32))
        f = b.op("ConstantOfShape", [_shape_of(b, b.pick(same))], value=value)
        return Val(b.op(b.pick(["Add", "Mul"]), [f, cur.name]), FLOAT, cur.shape)
    if kind == "mul0":  # a uniform made inside the branch, read next to another outer value
        z = b.op("Mul", [cur.name, b.const(np.zeros((), np.float32))])
        return Val(b.op("Add", [z, b.pick(same).name]), FLOAT, cur.shape)
    if kind == "outer":
        return Val(b.op(b.pick(["Add", "Mul", "Max"]), [cur.name, b.pick(same).name]), FLOAT, cur.shape)
    if kind == "row" and cur.shape and isinstance(cur.shape[-1], int):  # x @ 0 + b: a row made inside the branch
        k = cur.shape[-1]
        m = b.op("MatMul", [cur.name, b.const(np.zeros((k, k), np.float32), "w")])
        r = b.op("Add", [m, b.const(b.fconst((k,)), "bias")])
        return Val(b.op(b.pick(["Add", "Mul"]), [r, b.pick(same).name]), FLOAT, cur.shape)
    if kind == "outer_shape":  # the shape of a value made inside the branch feeds a reshape of an outer value
        inner = b.op("Relu", [cur.name])
        return Val(b.op("Reshape", [b.pick(same).name, b.op("Shape", [inner])]), FLOAT, cur.shape)
    if kind == "nested":
        return _scoped_if(b, [*pool, cur], cur, depth + 1)
    return cur


def _scoped_branch(b: _Builder, pool: list[Val], x: Val, name: str, depth: int) -> onnx.GraphProto:
    outer_nodes, outer_inits = b.nodes, b.initializers
    b.nodes, b.initializers = [], []
    try:
        cur = x
        for _ in range(int(b.rng.integers(1, 4))):
            cur = _scoped_step(b, pool, cur, depth)
        out = b.op("Identity", [cur.name]) if not b.nodes or b.chance(0.3) else cur.name
        return helper.make_graph(
            b.nodes, name, [], [helper.make_tensor_value_info(out, FLOAT, list(x.shape))], b.initializers
        )
    finally:
        b.nodes, b.initializers = outer_nodes, outer_inits


def _scoped_if(b: _Builder, pool: list[Val], x: Val, depth: int = 0) -> Val:
    cond = _cond(b, x)
    then_branch = _scoped_branch(b, pool, x, b.fresh("then"), depth)
    else_branch = _scoped_branch(b, pool, x, b.fresh("else"), depth)
    return Val(b.op("If", [cond], then_branch=then_branch, else_branch=else_branch), FLOAT, x.shape)


def op_if_scoped(b: _Builder, pool: list[Val]) -> list[Val]:
    """An If whose branches read outer values (version 2); its output's shape sometimes feeds outer ops."""
    x = b.pick(_floats(pool))
    if b.chance(0.3):  # an outer uniform the branches read
        pool = [*pool, Val(b.op("Mul", [x.name, b.const(np.zeros((), np.float32))]), FLOAT, x.shape)]
    out = _scoped_if(b, pool, x)
    new = [out]
    same = [v for v in _floats(pool) if v.shape == x.shape]
    if b.chance(0.4):
        last = x.shape[-1] if x.shape and isinstance(x.shape[-1], int) else 1
        c = b.const(b.fconst(b.pick([(), (last,)])))
        new.append(Val(b.op("Expand", [c, _shape_of(b, out)]), FLOAT, x.shape))
    if b.chance(0.4):
        new.append(Val(b.op("Reshape", [b.pick(same).name, _shape_of(b, out)]), FLOAT, x.shape))
    return new


def op_gated(b: _Builder, pool: list[Val]) -> list[Val]:
    """x + g * f(x) with a gate g: what the gated-branch rewrite matches."""
    cands = [v for v in _floats(pool) if len(v.shape) >= 2 and isinstance(v.shape[-1], int)]
    if not cands:
        return []
    x = b.pick(cands)
    h = b.op(b.pick(["Relu", "Gelu" if b.opset >= 20 else "Sigmoid", "Tanh"]), [x.name])
    gshape = (*x.shape[:-1], 1)
    g = b.op("Sigmoid", [b.op("ReduceMean", [x.name, b.i64([-1])], keepdims=1)]) if b.opset >= 18 else None
    if g is None:
        g = b.op("Sigmoid", [b.op("ReduceSum", [x.name, b.i64([-1])], keepdims=1)])
    if b.chance(0.3):
        g = b.op("Cast", [b.op("Cast", [g], to=TensorProto.DOUBLE)], to=FLOAT)
    del gshape
    return [Val(b.op("Add", [x.name, b.op("Mul", [g, h])]), FLOAT, x.shape)]


OPS: list[tuple[Callable[[_Builder, list[Val]], list[Val]], float]] = [
    (op_unary, 6),
    (op_clip, 1),
    (op_binary, 6),
    (op_compare_where, 3),
    (op_cast, 1.5),
    (op_matmul, 3),
    (op_reshape, 1.5),
    (op_transpose, 1.5),
    (op_slice, 1.5),
    (op_gather, 1),
    (op_concat, 1.5),
    (op_split, 1),
    (op_unsqueeze, 1),
    (op_squeeze, 0.5),
    (op_expand, 1),
    (op_flatten_tile, 0.7),
    (op_reduce, 2),
    (op_argmax_cumsum, 0.7),
    (op_norm, 1.5),
    (op_shape_ops, 1.5),
    (op_pad, 1),
    (op_trilu, 0.5),
    (op_matmul_integer, 0.7),
    (op_if, 1.5),
    (op_gated, 1),
]
# Version 2: version 1's ops (the same order) and If nodes whose branches read outer values.
OPS_BY_VERSION = {1: OPS, 2: [*OPS, (op_if_scoped, 2)]}


def generate(seed: int, version: int = VERSION) -> onnx.ModelProto:
    """A random model for ``seed`` (deterministic for each generator ``version``)."""
    if version not in OPS_BY_VERSION:
        raise ValueError(f"generator version {version} is not one of {sorted(OPS_BY_VERSION)}")
    ops = OPS_BY_VERSION[version]
    rng = np.random.default_rng(seed)
    opset = int(rng.integers(17, 21))
    b = _Builder(rng, opset)
    shapes = [("N", 4), ("N", "S", 4), (2, 4), ("N", 3), (4,), (3, 2, 4)]
    inputs: list[Val] = []
    for k in range(int(rng.integers(1, 4))):
        inputs.append(Val(f"x{k}", FLOAT, b.pick(shapes) if k == 0 or b.chance(0.5) else inputs[0].shape))
    pool = list(inputs)
    # Constant sources: what they feed folds at compile time (constant subgraphs, Case 1 of FoldConstants).
    sources: list[Val] = []
    for _ in range(int(rng.integers(0, 3))):
        shape = b.pick([(4,), (1, 4), (2, 4), (3,), (2, 3, 4)])
        sources.append(Val(b.const(b.fconst(shape), "k"), FLOAT, shape))
    pool.extend(sources)
    target = int(rng.integers(5, 41))
    weights = np.array([w for _, w in ops])
    weights /= weights.sum()
    tries = 0
    while len(b.nodes) < target and tries < 200:
        tries += 1
        maker = ops[int(rng.choice(len(ops), p=weights))][0]
        try:
            new = maker(b, pool)
        except (ValueError, IndexError):  # pick() from an empty candidate list
            continue
        # Prefer recent values: the graph gets deep, not only wide.
        pool.extend(v for v in new if v.shape is not None and len(v.shape) <= 4)
        pool = pool[-8:] if len(pool) > 8 and b.chance(0.3) else pool
    produced = {o for n in b.nodes for o in n.output}
    outs = [v for v in pool if v.name in produced] or [pool[-1]]
    chosen: list[Val] = []
    for v in [outs[-1]] + [b.pick(outs) for _ in range(int(rng.integers(0, 3)))]:
        if v not in chosen:
            chosen.append(v)
    if b.chance(0.15):
        chosen.append(chosen[0])  # the same value listed twice as an output
    graph_outputs = [
        helper.make_tensor_value_info(v.name, v.dtype, list(v.shape) if b.chance(0.7) else [None] * len(v.shape))
        for v in chosen
    ]
    # Sometimes a constant source is also a graph input: an overridable initializer, never a constant.
    if sources and b.chance(0.3):
        inputs.append(b.pick(sources))
    graph = helper.make_graph(
        b.nodes,
        f"fuzz{seed}",
        [helper.make_tensor_value_info(v.name, v.dtype, list(v.shape)) for v in inputs],
        graph_outputs,
        b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    if b.chance(0.5):
        with contextlib.suppress(Exception):  # value_info present
            model = onnx.shape_inference.infer_shapes(model)
    return model
