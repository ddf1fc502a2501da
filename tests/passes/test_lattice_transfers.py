"""Every lattice transfer against onnxruntime: seeded random uniforms of every dtype the op accepts.

For each op the transfer function (``passes/_lattice.py``) is asked for the output scalar given
uniform inputs; onnxruntime runs the same node on full tensors of those scalars. Where the transfer
answers, every element ORT computes must equal it (float rounding aside). Combinations ORT has no
kernel for are skipped per combination; a test where no combination ran fails.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.passes._lattice import transfer
from layerzero.passes.shape_inference import InferShapes

SHAPE = (2, 3)
FLOATS = [np.float16, np.float32, np.float64]
SIGNED = [np.int32, np.int64]
UNSIGNED = [np.uint8]


def _tensor_type(dtype: np.dtype) -> int:
    return oh.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _session(proto: onnx.ModelProto) -> ort.InferenceSession | None:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # no kernel for (or no such) type: the combination does not exist at run time
        text = str(exc)
        if "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text or "Type Error: Type" in text:
            return None
        raise


def _check(
    op: str,
    scalars: list[np.ndarray | None],
    out_dtype: np.dtype | None = None,
    attrs: dict | None = None,
    opset: int = 20,
    runtime: set[int] = frozenset(),
    shapes: list[tuple[int, ...]] | None = None,
    rtol: float = 1e-6,
) -> str:
    """Compare the transfer of ``op`` with ORT; inputs listed in ``runtime`` are graph inputs to the transfer.

    Returns "agree", "unknown" (the transfer gave up) or "no-kernel".
    """
    names = [f"x{k}" if s is not None else "" for k, s in enumerate(scalars)]
    shapes = shapes or [SHAPE] * len(scalars)
    inputs = [
        oh.make_tensor_value_info(n, _tensor_type(np.asarray(s).dtype), shape)
        for n, s, shape in zip(names, scalars, shapes)
        if n
    ]
    out_type = _tensor_type(out_dtype) if out_dtype is not None else 0
    node = oh.make_node(op, names, ["y"], **(attrs or {}))
    graph = oh.make_graph([node], "g", inputs, [oh.make_tensor_value_info("y", out_type, None)])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    proto.ir_version = 10
    proto = onnx.shape_inference.infer_shapes(proto)
    sess = _session(proto)
    if sess is None:
        return "no-kernel"
    feeds = {n: np.full(shape, s, dtype=np.asarray(s).dtype) for n, s, shape in zip(names, scalars, shapes) if n}
    (expected,) = sess.run(None, feeds)
    model = ir.from_proto(proto)
    InferShapes()(model)
    ir_node = next(iter(model.graph))
    known = [None if (k in runtime or s is None) else np.asarray(s) for k, s in enumerate(scalars)]
    (got,) = transfer(ir_node, known, assume_finite=True)
    if got is None:
        return "unknown"
    assert got.dtype == expected.dtype, (op, scalars, got.dtype, expected.dtype)
    if expected.dtype.kind == "f":
        tol = 2e-3 if expected.dtype == np.float16 else rtol
        np.testing.assert_allclose(
            expected, np.full(expected.shape, got), rtol=tol, atol=tol, err_msg=f"{op} {scalars}"
        )
    else:
        np.testing.assert_array_equal(expected, np.full(expected.shape, got), err_msg=f"{op} {scalars}")
    return "agree"


def _values(rng: np.random.Generator, dtype: type, n: int = 2) -> list[np.ndarray]:
    if np.dtype(dtype).kind == "f":
        picks = [0.0, 1.0, -1.0, 0.5, *list(rng.uniform(-3, 3, n))]
    elif np.dtype(dtype).kind == "u":
        picks = [0, 1, *list(rng.integers(0, 9, n))]
    else:
        picks = [0, 1, -1, *list(rng.integers(-9, 9, n))]
    return [np.asarray(v, dtype=dtype) for v in picks]


UNARY_FLOAT = [
    "Abs", "Ceil", "Cos", "Cosh", "Erf", "Exp", "Floor", "Identity", "Neg", "Reciprocal", "Relu", "Round",
    "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Tan", "Tanh", "Acos", "Asin", "Atan", "Acosh", "Asinh",
    "Atanh", "Softsign", "Mish", "HardSwish", "Log", "Sqrt", "IsNaN", "IsInf",
]  # fmt: skip
UNARY_INT = ["Abs", "Neg", "Relu", "Sign", "Identity"]


@pytest.mark.parametrize("op", UNARY_FLOAT)
def test_unary_float_transfers_equal_ort(op):
    rng = np.random.default_rng(1)
    ran = 0
    for dtype in FLOATS:
        for c in _values(rng, dtype):
            out = np.bool_ if op in ("IsNaN", "IsInf") else None
            ran += _check(op, [c], out) == "agree"
    assert ran > 0, f"{op}: no dtype ran"


@pytest.mark.parametrize("op", UNARY_INT)
def test_unary_int_transfers_equal_ort(op):
    rng = np.random.default_rng(2)
    ran = sum(_check(op, [c]) == "agree" for dtype in SIGNED for c in _values(rng, dtype))
    assert ran > 0


ACTIVATIONS = [
    ("Gelu", {"approximate": "none"}, 20),
    ("Gelu", {"approximate": "tanh"}, 20),
    ("Elu", {"alpha": 0.7}, 18),
    ("Selu", {}, 18),
    ("Selu", {"alpha": 1.3, "gamma": 0.9}, 18),
    ("Celu", {"alpha": 1.5}, 18),
    ("LeakyRelu", {"alpha": 0.2}, 18),
    ("ThresholdedRelu", {"alpha": 0.4}, 18),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, 18),
    ("Shrink", {"bias": 0.2, "lambd": 0.3}, 18),
]


@pytest.mark.parametrize(("op", "attrs", "opset"), ACTIVATIONS, ids=lambda p: str(p))
def test_activation_transfers_equal_ort(op, attrs, opset):
    rng = np.random.default_rng(3)
    ran = 0
    for dtype in FLOATS:
        for c in _values(rng, dtype):
            ran += _check(op, [c], attrs=attrs, opset=opset, rtol=1e-5) == "agree"
    assert ran > 0


BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"]


@pytest.mark.parametrize("op", BINARY)
def test_binary_transfers_equal_ort(op):
    rng = np.random.default_rng(4)
    ran = 0
    for dtype in FLOATS + SIGNED:
        values = _values(rng, dtype)
        for a in values[1:5]:
            for b in values[:5]:
                if op == "Div" and np.asarray(b).dtype.kind == "i" and b == 0:
                    continue  # integer division by zero is undefined in ORT (it traps)
                ran += _check(op, [a, b]) == "agree"
    assert ran > 0


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical_transfers_equal_ort(op):
    ran = 0
    for a in (np.bool_(False), np.bool_(True)):
        for b in (np.bool_(False), np.bool_(True)):
            ran += _check(op, [a, b]) == "agree"
            # x and false, x or true: known with one run-time operand
            _check(op, [a, b], runtime={0})
    assert ran == 4


def test_integer_pow_by_a_negative_exponent_is_what_ort_computes():
    # Issue 14, cause 1: numpy raises on integers to negative integer powers.
    outcomes = []
    for dtype in SIGNED:
        for base in (2, -2, 1, -1, 3, 0):
            for exponent in (-1, -2, -3, 2):
                outcomes.append(_check("Pow", [np.asarray(base, dtype), np.asarray(exponent, dtype)]))
    assert outcomes.count("agree") >= 30
    # 0 ** -1 is out of range for an integer: the transfer gives up rather than guess.
    assert "unknown" in outcomes


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_variadic_and_where_transfers_equal_ort(dtype):
    rng = np.random.default_rng(5)
    values = _values(rng, dtype)
    ran = 0
    for op in ("Sum", "Max", "Min", "Mean"):
        for a, b, c in zip(values, values[1:], values[2:]):
            ran += _check(op, [a, b, c]) in ("agree", "no-kernel")
    for cond in (np.bool_(True), np.bool_(False)):
        ran += _check("Where", [cond, values[0], values[1]]) == "agree"
        _check("Where", [cond, values[0], values[0]], runtime={0})  # equal branches
    assert ran >= 10


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8])
def test_clip_transfer_equal_ort_including_run_time_bounds(dtype):
    rng = np.random.default_rng(6)
    values = _values(rng, dtype)
    ran = 0
    for c in values:
        lo, hi = sorted(values[2:4])
        shapes = [SHAPE, (), ()]
        ran += _check("Clip", [c, lo, hi], shapes=shapes) == "agree"
        ran += _check("Clip", [c, lo], shapes=shapes[:2]) == "agree"
        assert _check("Clip", [c, lo, hi], runtime={2}, shapes=shapes) in ("unknown", "no-kernel")  # run-time max
    assert ran > 0


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_of_a_uniform_is_one_over_n(op):
    outcomes = [_check(op, [np.asarray(c, np.float32)], attrs={"axis": axis}) for c in (0.0, 2.5) for axis in (1, -1)]
    assert outcomes == ["agree"] * 4
    # opset 11: axis 0 flattens the axes from 0 on; the transfer does not guess
    assert _check(op, [np.asarray(1.0, np.float32)], attrs={"axis": 0}, opset=11) == "unknown"


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_pad_reads_a_run_time_constant_value_as_unknown(dtype):
    # Issue 14, cause 5: Pad(uniform, pads, constant_value) with constant_value not known.
    c = np.asarray(3, dtype)
    pads = np.asarray([1, 0, 0, 1], np.int64)
    shapes = [SHAPE, (4,), ()]
    assert _check("Pad", [c, pads, np.asarray(0, dtype)], runtime={2}, shapes=shapes) == "unknown"
    assert _check("Pad", [c, pads, np.asarray(3, dtype)], shapes=shapes) == "agree"
    assert _check("Pad", [c, pads, np.asarray(0, dtype)], shapes=shapes) == "unknown"  # not uniform
    assert _check("Pad", [c, pads], shapes=shapes[:2]) == "unknown"  # padded with 0
    assert _check("Pad", [c, pads], attrs={"mode": "edge"}, shapes=shapes[:2]) == "agree"


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_matmul_integer_respects_both_zero_points(dtype):
    # Issue 14, cause 4: MatMulInteger(a, b, azp, bzp) = sum_k (a - azp)(b - bzp).
    shapes = [(2, 3), (3, 4), (), ()]
    outcomes = []
    for a in (0, 2, 5):
        for b in (0, 1, 7):
            for azp in (0, 2):
                for bzp in (0, 1):
                    scal = [np.asarray(a, dtype), np.asarray(b, dtype), np.asarray(azp, dtype), np.asarray(bzp, dtype)]
                    outcomes.append(_check("MatMulInteger", scal, shapes=shapes))
                    outcomes.append(_check("MatMulInteger", scal, shapes=shapes, runtime={1}))
    assert outcomes.count("agree") >= 36
    # a = 0 with a non-zero zero point and b at run time: not zero, not uniform -> unknown
    scal = [np.asarray(0, dtype), np.asarray(7, dtype), np.asarray(2, dtype), np.asarray(1, dtype)]
    assert _check("MatMulInteger", scal, shapes=shapes, runtime={1}) == "unknown"


def test_cast_transfer_equal_ort():
    ran = 0
    for src in (np.float32, np.float64, np.int64, np.int32):
        for c in (0, 1, -2, 3.75 if np.dtype(src).kind == "f" else 7):
            for to in (np.float16, np.float32, np.int64, np.int32, np.bool_):
                if np.dtype(to).kind in "iu" and np.dtype(src).kind == "f" and not float(c).is_integer():
                    continue  # float -> int of a fraction rounds by the platform
                ran += _check("Cast", [np.asarray(c, src)], attrs={"to": _tensor_type(to)}) == "agree"
    assert ran > 40
    assert math.isfinite(ran)


# ------------------------------------------------------------------------------------ row constants

ROW_CASES = [
    ("Add", {}, [("const", (4,))]),
    ("Mul", {}, [("const", (3, 1))]),
    ("Div", {}, [("const", (4,))]),
    ("Gelu", {}, []),
    ("Tanh", {}, []),
    ("Sigmoid", {}, []),
    ("LeakyRelu", {"alpha": 0.3}, []),
    ("MatMul", {}, [("const", (4, 5))]),
    ("LayerNormalization", {"axis": -1}, [("const", (4,)), ("const", (4,))]),
    ("ReduceMean", {"keepdims": 1}, [("axes", [-1])]),
    ("ReduceMax", {"keepdims": 0}, [("axes", [0, 2])]),
    ("Softmax", {"axis": -1}, []),
    ("Transpose", {"perm": [2, 0, 1]}, []),
    ("Unsqueeze", {}, [("axes", [0, -1])]),
    ("Slice", {}, [("ints", [1]), ("ints", [3]), ("ints", [-1])]),
    ("Gather", {"axis": 2}, [("ints", [3, 0])]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("op", "attrs", "extra"), ROW_CASES, ids=[c[0] + str(i) for i, c in enumerate(ROW_CASES)])
def test_row_transfers_equal_ort(op, attrs, extra, dtype):
    """A row R broadcast to [2, 3, 4] through ``op``: the transfer's row, broadcast, is what ORT computes."""
    from layerzero.passes._rows import transfer_row
    from layerzero.passes._shapes import SymbolicShapes

    rng = np.random.default_rng(7)
    ran = kernels = 0
    for row_shape in [(4,), (3, 4), (1, 4), (3, 1)]:
        row = rng.uniform(-2, 2, row_shape).astype(dtype)
        if op in ("LayerNormalization", "Softmax", "MatMul") and row_shape[-1] == 1:
            continue  # the row must span the normalised / contracted axis
        inits, names = [], ["x"]
        for k, (kind, spec) in enumerate(extra):
            value = rng.uniform(-1, 1, spec).astype(dtype) if kind == "const" else np.asarray(spec, dtype=np.int64)
            inits.append(oh.make_tensor(f"c{k}", _tensor_type(value.dtype), value.shape, value.reshape(-1).tolist()))
            names.append(f"c{k}")
        node = oh.make_node(op, names, ["y"], **attrs)
        x_info = oh.make_tensor_value_info("x", _tensor_type(np.dtype(dtype)), ["B", 3, 4])
        graph = oh.make_graph([node], "g", [x_info], [oh.make_tensor_value_info("y", 0, None)], inits)
        proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
        proto.ir_version = 10
        proto = onnx.shape_inference.infer_shapes(proto)
        sess = _session(proto)
        if sess is None:
            continue
        kernels += 1
        (expected,) = sess.run(None, {"x": np.ascontiguousarray(np.broadcast_to(row, (2, 3, 4)))})
        model = ir.from_proto(proto)
        InferShapes()(model)
        shapes = SymbolicShapes(model.graph)
        ir_node = next(iter(model.graph))
        ins = [row] + [v.const_value.numpy() for v in ir_node.inputs[1:]]

        def rank_of(value, shapes=shapes):
            dims = shapes.dims(value)
            return None if dims is None else len(dims)

        (got,) = transfer_row(ir_node, ins, rank_of, shapes.dims, assume_finite=True)[:1]
        if got is None:
            continue
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(
            np.broadcast_to(got, expected.shape), expected, rtol=1e-5, atol=1e-6, err_msg=f"{op} {row_shape}"
        )
        ran += 1
    if kernels == 0:
        pytest.skip(f"onnxruntime has no CPU kernel for {op} on {np.dtype(dtype).name}")
    assert ran > 0, f"{op}: the row transfer never answered"
