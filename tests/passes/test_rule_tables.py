"""Every row of the rule tables fires: PropagateUniforms' IDENTITIES, the lattice's ABSORBING and TRANSFERS.

Each test is parametrised over a table itself, so a row added to a table is exercised here with no new test: an
identity row must be the rule that bypasses its op (its operand order included), an absorbing row must decide its
op's result alone, and every op of TRANSFERS must give a uniform for some uniform inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.passes import InferShapes, PropagateUniforms
from layerzero.passes._lattice import ABSORBING, TRANSFERS, UNARY, UNARY_ATTR, Absorbing, transfer
from layerzero.passes.uniform_propagation import IDENTITIES, Identity

_BOOL_OPS = {"And", "Or", "Xor", "Not"}


def _witness(rule: Identity | Absorbing, dtype: str) -> str:
    """A constant (ONNX text) that passes the rule's test."""
    for value in (0, 1):
        scalar = np.asarray(bool(value)) if dtype == "bool" else np.asarray(float(value))
        if rule.test(scalar):
            return f"{dtype} k = {{{value}}}"
    raise AssertionError(f"no witness for {rule}")


# The data-movement identities: (the node's extra inputs and attributes, initializers), keeping x: float[2,4].
_KEEPING = {
    "Reshape": ("Reshape (x, shape)", "int64[2] shape = {2, 4}"),
    "Expand": ("Expand (x, shape)", "int64[2] shape = {2, 4}"),
    "Cast": ("Cast <to: int = 1> (x)", ""),
    "Identity": ("Identity (x)", ""),
    "CastLike": ("CastLike (x, like)", "float like = {1}"),
}


def _identity_model(rule: Identity) -> str:
    dtype = "bool" if rule.op in _BOOL_OPS else "float"
    if rule.operand is None:
        node, init = _KEEPING[rule.op]
    else:
        arity = 3 if rule.op == "Where" else 2
        names = ["k" if k == rule.operand else "x" if k == rule.result else "w" for k in range(arity)]
        node, init = f"{rule.op} ({', '.join(names)})", _witness(rule, "bool" if rule.op == "Where" else dtype)
    reader = "Not" if dtype == "bool" else "Relu"
    return f"""
        <ir_version: 9, opset_import: ["" : 18]>
        g ({dtype}[2,4] x, {dtype}[2,4] w) => ({dtype}[2,4] z) <{init}> {{
           y = {node}
           z = {reader} (y)
        }}"""


@pytest.mark.parametrize("rule", IDENTITIES, ids=lambda r: f"{r.op}-{r.operand}-{r.result}")
def test_every_identity_row_bypasses_its_op(rule: Identity) -> None:
    model = ir.from_proto(onnx.parser.parse_model(_identity_model(rule)))
    InferShapes()(model)
    assert PropagateUniforms()(model).modified
    (reader,) = [n for n in model.graph if n.outputs[0].name == "z"]
    assert reader.inputs[0] is model.graph.inputs[0], f"{rule}: the reader reads {reader.inputs[0].name}"


@pytest.mark.parametrize("rule", ABSORBING, ids=lambda r: f"{r.op}-{r.operand}")
def test_every_absorbing_row_decides_its_op(rule: Absorbing) -> None:
    dtype = "bool" if rule.op in _BOOL_OPS else "float"
    c = np.asarray(float(_witness(rule, dtype).split("{")[1][0]))
    c = c.astype(bool) if dtype == "bool" else c.astype(np.float32)
    ins = [None, None]
    ins[rule.operand] = c
    node = _node(rule.op, 2, ir.DataType.BOOL if dtype == "bool" else ir.DataType.FLOAT)
    (out,) = transfer(node, ins, assume_finite=True)
    assert out is not None and out == rule.value(c), (rule, out)
    if rule.finite:  # only under assume_finite
        assert transfer(node, ins, assume_finite=False) == [None]


def _node(op: str, arity: int, dtype: ir.DataType, outputs: int = 1, **attrs) -> ir.Node:
    shape = (2, 3)
    inputs = [ir.Value(name=f"x{k}", shape=ir.Shape(shape), type=ir.TensorType(dtype)) for k in range(arity)]
    node = ir.node(op, inputs, attributes=attrs, num_outputs=outputs)
    for out in node.outputs:
        out.dtype = ir.DataType.FLOAT if dtype != ir.DataType.BOOL else dtype
    return node


# Inputs that make an op's transfer answer, where the default (every input the uniform 0.5, float) does not.
_EXAMPLES: dict[str, tuple[int, list, ir.DataType]] = {
    "Not": (1, [np.asarray(True)], ir.DataType.BOOL),
    "And": (2, [np.asarray(True), np.asarray(False)], ir.DataType.BOOL),
    "Or": (2, [np.asarray(True), np.asarray(False)], ir.DataType.BOOL),
    "Xor": (2, [np.asarray(True), np.asarray(False)], ir.DataType.BOOL),
    "BitwiseNot": (1, [np.asarray(3, np.int64)], ir.DataType.INT64),
    "Where": (3, [np.asarray(True), np.float32(1), np.float32(2)], ir.DataType.FLOAT),
    "ReduceSum": (1, [np.float32(0)], ir.DataType.FLOAT),
    "CumSum": (2, [np.float32(0), None], ir.DataType.FLOAT),
    "Pad": (2, [np.float32(0), None], ir.DataType.FLOAT),
    "ConstantOfShape": (1, [None], ir.DataType.INT64),
    "Gemm": (2, [np.float32(0), None], ir.DataType.FLOAT),
    "Conv": (2, [np.float32(0), None], ir.DataType.FLOAT),
    "Einsum": (2, [np.float32(0), None], ir.DataType.FLOAT),
    "MatMulInteger": (2, [np.uint8(1), np.uint8(2)], ir.DataType.UINT8),
    "com.microsoft::MatMulNBits": (2, [np.float32(0), None], ir.DataType.FLOAT),
}
_ONE_INPUT = {"Clip", "Softmax", "LogSoftmax", "Split", "Concat"}


@pytest.mark.parametrize("op", sorted(TRANSFERS))
def test_every_transfer_row_gives_a_uniform(op: str) -> None:
    if op in _EXAMPLES:
        arity, ins, dtype = _EXAMPLES[op]
    else:
        arity = 1 if op in _ONE_INPUT or op in ("Identity", "Cast") else 2
        if op in UNARY or op in UNARY_ATTR:
            arity = 2 if op == "CastLike" else 1
        ins, dtype = [np.float32(0.5)] * arity, ir.DataType.FLOAT
    attrs = {"equation": "ij,jk->ik"} if op == "Einsum" else {}
    node = _node(op, arity, dtype, outputs=2 if op == "Split" else 1, **attrs)
    outs = transfer(node, list(ins), assume_finite=True)
    assert outs[0] is not None, f"{op}: no uniform for uniform inputs {ins}"
