"""``_shapes`` rules: each rule alone (pure functions), then the rules together on graphs shaped like exports.

The graph tests check facts against what onnxruntime computes at two sizes of the symbolic dims, so a wrong
fact fails (the rules must never state one); unknown is allowed and asserted where it is the right answer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.passes._shapes import (
    SymbolicShapes,
    reshape_wildcard,
    slice_length,
    split_lengths,
    vector_elementwise,
    vector_where,
)

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'
INT_MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------------ pure rules


@pytest.mark.parametrize(
    ("source", "known", "expected"),
    [
        (["b", "s", 64], ["b", "s", 16], 4),  # split heads: [b, s, 64] -> [b, s, -1, 16]
        (["b", "s", 4, 16], ["b", "s"], 64),  # merge heads: [b, s, 4, 16] -> [b, s, -1]
        (["b", "s"], ["s"], "b"),  # [b, s] -> [-1, s]
        (["b", "s", 64], [64], None),  # b * s: a product of classes is no single dim
        (["b", "s", 64], ["t", 16], None),  # t does not cancel
        ([6, 5], [4], None),  # 30 / 4 is not whole: a malformed Reshape gets no fact
        (["b", 2, 8], [4, 4], "b"),  # the static parts cancel to 1
        (["b", 8], [16], None),  # 8 / 16: the count left is b / 2, not a dim
        ([3, 0], [5], 0),
        (["b"], [0], None),  # division by a zero size
    ],
)
def test_reshape_wildcard(source, known, expected) -> None:
    assert reshape_wildcard(source, known) == expected


@pytest.mark.parametrize(
    ("dim", "start", "end", "step", "expected"),
    [
        (64, -1, INT_MAX, 1, 1),  # torch.onnx's x.shape[-1]
        (64, 0, 16, 1, 16),
        (64, 60, 100, 1, 4),  # clamped
        (10, -1, -(2**63), -1, 10),  # reversed
        (10, 1, 8, 3, 3),
        ("s", 0, INT_MAX, 1, "s"),  # x[:, :]
        ("s", 0, 2**31 - 1, 1, "s"),
        ("s", -INT_MAX, INT_MAX, 1, "s"),
        ("s", 1, INT_MAX, 1, None),  # s - 1 (or 0): no dim says that
        ("s", 0, 5, 1, None),  # min(s, 5)
        ("s", 0, INT_MAX, 2, None),
        (5, 0, 5, 0, None),  # step 0 is invalid
    ],
)
def test_slice_length(dim, start, end, step, expected) -> None:
    assert slice_length(dim, start, end, step) == expected


@pytest.mark.parametrize(
    ("dim", "sizes", "parts", "expected"),
    [
        (192, [64, 64, 64], 3, [64, 64, 64]),  # GPT-2's fused qkv
        (192, None, 3, [64, 64, 64]),
        (10, None, 3, [4, 4, 2]),  # opset 18: ceil chunks, the last gets the rest
        ("s", None, 1, ["s"]),
        ("s", None, 2, [None, None]),
        (192, [64, 128], 3, [None, None, None]),  # sizes that do not match the outputs
    ],
)
def test_split_lengths(dim, sizes, parts, expected) -> None:
    assert split_lengths(dim, sizes, parts) == expected


@pytest.mark.parametrize(
    ("op", "a", "b", "expected"),
    [
        ("Equal", ["b", 1, "s", "s"], [-1], [0, 0, 0, 0]),  # a size is never -1
        ("Equal", ["b", -1, "s"], [-1, -1, -1], [0, 1, 0]),
        ("Equal", ["s"], ["s"], [1]),
        ("Equal", ["s"], ["t"], None),  # may or may not be equal
        ("Equal", ["s"], [3], None),  # s may be 3
        ("Mul", [1, 1, 1, 1], [-1], [-1, -1, -1, -1]),
        ("Mul", ["s", 2], [1], ["s", 2]),
        ("Mul", ["s"], [0], [0]),
        ("Mul", ["s"], [2], None),  # 2s: not representable
        ("Add", ["s", 3], [0, 1], ["s", 4]),
        ("Sub", ["s"], ["s"], [0]),
        ("Sub", ["s"], [1], None),
        ("Div", [64, "s"], [16, 1], [4, "s"]),
        ("Div", [-7], [2], None),  # ONNX truncates toward 0, Python floors: left unknown
        ("Div", ["s"], ["s"], None),  # 0 / 0 when s is 0
        ("Max", [3, 5], [4], [4, 5]),
        ("Max", ["s"], [1], None),
        ("Add", [1, 2], [1, 2, 3], None),  # not broadcastable
    ],
)
def test_vector_elementwise(op, a, b, expected) -> None:
    assert vector_elementwise(op, a, b) == expected


def test_vector_where() -> None:
    shape = ["b", -1, "s", "s"]
    assert vector_where([0, 1, 0, 0], [1, 1, 1, 1], shape) == ["b", 1, "s", "s"]  # expand(-1): keep the axis
    assert vector_where([1], ["b"], [3]) == ["b"]
    assert vector_where(["b", 0], [1, 1], [2, 2]) is None  # a condition that is not known
    assert vector_where([1, 0], [1, 2, 3], [1]) is None


# ------------------------------------------------------------------------------------------------ graphs


def _ort_shapes(helpers, model: ir.Model, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, tuple]:
    """Run-time shapes of ``names`` (made graph outputs of a copy of ``model``)."""
    proto = helpers.to_proto(model)
    del proto.graph.output[:]
    for name in names:
        proto.graph.output.add().name = name
    outs = helpers.session(proto).run(names, feeds)
    return {n: tuple(o.shape) for n, o in zip(names, outs)}


def _check_facts(helpers, model: ir.Model, sizes: list[dict[str, int]]) -> SymbolicShapes:
    """Every dim the rules state equal (same class / same static size) is equal at run time, at every size."""
    helpers.infer_shapes(model)
    shapes = SymbolicShapes(model.graph)
    values = [v for n in model.graph for v in n.outputs]
    names = [v.name for v in values]
    for size in sizes:
        feeds = {}
        for inp in model.graph.inputs:
            dims = [d if isinstance(d, int) else size[str(d)] for d in inp.shape]
            feeds[inp.name] = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
        real = _ort_shapes(helpers, model, feeds, names)
        by_class: dict[object, int] = {}
        for v in values:
            dims = shapes.dims(v)
            if dims is None:
                continue
            assert len(dims) == len(real[v.name]), v.name
            for d, n in zip(dims, real[v.name]):
                if isinstance(d, int):
                    assert d == n, f"{v.name}: static {d}, run time {n}"
                else:
                    assert by_class.setdefault(d, n) == n, f"{v.name}: class {d} is {by_class[d]} and {n}"
    return shapes


def _value(model: ir.Model, name: str) -> ir.Value:
    return next(v for n in model.graph for v in n.outputs if v.name == name)


def _batch_seq_graph(body: str) -> str:
    """x [batch, seq, 64] -> y: ``body`` after x's batch and seq dims as 1-D int64 ``bb`` and ``ss`` (and ``b``,
    ``s``, ``i0``, ``i1``, ``u0``), computed as the exporters compute them."""
    return (
        HEADER
        + """
    g (float[batch, seq, 64] x) => (y) {
        sh = Shape(x)
        i0 = Constant<value = int64 {0}>()
        i1 = Constant<value = int64 {1}>()
        b = Gather(sh, i0)
        s = Gather(sh, i1)
        u0 = Constant<value = int64[1] {0}>()
        bb = Unsqueeze(b, u0)
        ss = Unsqueeze(s, u0)
"""
        + body
        + """
    }
    """
    )


ATTENTION = _batch_seq_graph(
    """
        heads = Constant<value = int64[2] {-1, 16}>()
        split_shape = Concat<axis = 0>(bb, ss, heads)
        qkv = Concat<axis = 2>(x, x, x)
        sizes = Constant<value = int64[3] {64, 64, 64}>()
        q, k, v = Split<axis = 2>(qkv, sizes)
        qh = Reshape(q, split_shape)
        kh = Reshape(k, split_shape)
        vh = Reshape(v, split_shape)
        qt = Transpose<perm = [0, 2, 1, 3]>(qh)
        kt = Transpose<perm = [0, 2, 3, 1]>(kh)
        vt = Transpose<perm = [0, 2, 1, 3]>(vh)
        scores = MatMul(qt, kt)
        mask = Constant<value = float[1] {0.0}>()
        masked = Add(scores, mask)
        p = Softmax<axis = -1>(masked)
        ctx = MatMul(p, vt)
        back = Transpose<perm = [0, 2, 1, 3]>(ctx)
        minus1 = Constant<value = int64[1] {-1}>()
        merge_shape = Concat<axis = 0>(bb, ss, minus1)
        merged = Reshape(back, merge_shape)
        y = Add(merged, x)
    """
)


def test_split_and_merge_heads_cancel(helpers) -> None:
    """GPT-2 (TorchScript): Split of the fused qkv, Reshape with -1 into heads and back: [b, s, 64] again."""
    model = helpers.parse(ATTENTION)
    shapes = _check_facts(helpers, model, [{"batch": 2, "seq": 5}, {"batch": 3, "seq": 1}])
    x = model.graph.inputs[0]
    assert shapes.dims(_value(model, "qh"))[2:] == [4, 16]
    assert shapes.dims(_value(model, "q"))[2] == 64
    assert shapes.same_shape(_value(model, "merged"), x)
    assert shapes.same_shape(_value(model, "y"), x)


EXPAND_MASK = _batch_seq_graph(
    """
        keep = Constant<value = int64[1] {-1}>()
        wanted = Concat<axis = 0>(bb, keep, ss, ss)
        flat = Reshape(wanted, keep)
        n = Shape(flat)
        ones = ConstantOfShape<value = int64[1] {1}>(n)
        neg = Constant<value = int64 {-1}>()
        minus = Mul(ones, neg)
        is_keep = Equal(flat, minus)
        target = Where(is_keep, ones, flat)
        r = Range(i0, s, i1)
        u1 = Constant<value = int64[2] {0, 1}>()
        row = Unsqueeze(r, u1)
        u3 = Constant<value = int64[3] {0, 1, 3}>()
        col = Unsqueeze(r, u3)
        u2 = Constant<value = int64[3] {0, 1, 2}>()
        row4 = Unsqueeze(r, u2)
        causal = LessOrEqual(row4, col)
        wide = Expand(causal, target)
        zero = Constant<value = float {0.0}>()
        low = Constant<value = float {-1000.0}>()
        mask = Where(wide, zero, low)
        y = Identity(mask)
    """
)


def test_expand_minus_one_mask(helpers) -> None:
    """torch's ``mask.expand(b, -1, s, s)`` through ConstantOfShape / Mul / Equal / Where of the shape vector."""
    model = helpers.parse(EXPAND_MASK)
    shapes = _check_facts(helpers, model, [{"batch": 2, "seq": 5}, {"batch": 3, "seq": 1}])
    x = model.graph.inputs[0]
    assert shapes.vector(_value(model, "ones")) == [1, 1, 1, 1]
    assert shapes.vector(_value(model, "minus")) == [-1, -1, -1, -1]
    assert shapes.vector(_value(model, "is_keep")) == [0, 1, 0, 0]
    target = shapes.vector(_value(model, "target"))
    xb, xs = shapes.dims(x)[:2]
    assert target == [xb, 1, xs, xs]
    assert shapes.dims(_value(model, "mask")) == [xb, 1, xs, xs]


def test_slice_of_a_static_axis_and_the_whole_axis(helpers) -> None:
    model = helpers.parse(
        HEADER
        + """
        g (float[batch, seq, 64] x) => (y) {
            s0 = Constant<value = int64[2] {0, 8}>()
            e0 = Constant<value = int64[2] {9223372036854775807, 24}>()
            ax = Constant<value = int64[2] {1, 2}>()
            a = Slice(x, s0, e0, ax)
            s1 = Constant<value = int64[1] {1}>()
            e1 = Constant<value = int64[1] {9223372036854775807}>()
            one = Constant<value = int64[1] {1}>()
            b = Slice(x, s1, e1, one)
            y = Identity(a)
        }
        """
    )
    shapes = _check_facts(helpers, model, [{"batch": 2, "seq": 5}, {"batch": 1, "seq": 3}])
    x = model.graph.inputs[0]
    assert shapes.dims(_value(model, "a")) == [*shapes.dims(x)[:2], 16]
    assert shapes.dims(_value(model, "b"))[1] != shapes.dims(x)[1]  # seq - 1: a dim of its own
