"""Constant weights and the linear leaves ``x @ W (+ b)`` of structured zeros (passes/structured_zeros.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._quantized import QuantizedWeight, is_matmul_nbits, quantized_operand, quantized_weight

MAX_WEIGHT_READ = 1 << 28  # elements: bigger weights are not read for structure
STD = ("", "ai.onnx")


def std(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in STD and node.op_type in ops


def node_label(node: ir.Node) -> str:
    """The node's name, else its first output's (text models have unnamed nodes)."""
    return node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else node.op_type)


def static_dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def last_dim(value: ir.Value | None) -> int | None:
    dims = static_dims(value)
    return dims[-1] if dims else None


def weight_array(value: ir.Value | None, *, own: bool = False) -> np.ndarray | None:
    """A constant 2-D float weight small enough to read (an initializer that is no graph input).

    ``own``: read by one node only. A shared weight (tied embeddings and LM head) would be duplicated by
    narrowing it for one reader, not removed.
    """
    if value is None or (own and len({user for user, _ in value.uses()}) != 1):
        return None
    tensor = value.const_value
    if tensor is not None and tensor.size > MAX_WEIGHT_READ:
        return None
    array = const_array(value)
    if array is None or array.ndim != 2 or array.dtype.kind != "f" or array.size == 0:
        return None
    return array


LINES_META_KEY = "layerzero.zero_lines"


def zero_lines(value: ir.Value, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zero rows, zero columns) of a constant 2-D weight, cached on the value.

    A zero row starts with a zero and a zero column is zero in row 0: only those candidates are read whole, so
    a dense weight costs one row and one column (memory-mapped pages stay cold), and the fixpoint's later
    iterations read nothing.
    """
    cached = value.meta.get(LINES_META_KEY)
    if cached is not None and cached[0].shape[0] == array.shape[0] and cached[1].shape[0] == array.shape[1]:
        return cached
    rows = np.zeros(array.shape[0], bool)
    cols = np.zeros(array.shape[1], bool)
    for k in np.flatnonzero(array[:, 0] == 0):
        rows[k] = not np.any(array[k])
    candidates = np.flatnonzero(array[0] == 0)
    for start in range(0, candidates.size, 256):  # a bounded temporary per block of columns
        block = candidates[start : start + 256]
        cols[block] = ~np.any(array[:, block] != 0, axis=0)
    value.meta[LINES_META_KEY] = (rows, cols)
    return rows, cols


@dataclasses.dataclass
class Matrix:
    """A constant weight in its math form ``[in, out]``: the stored array (``transposed`` for Gemm's
    ``transB``) times ``alpha``, read lazily; or a quantized weight (``quant``: MatMulNBits, DequantizeLinear,
    read through passes/_quantized.py, ``array`` None)."""

    value: ir.Value
    array: np.ndarray | None
    transposed: bool = False
    alpha: float = 1.0
    quant: QuantizedWeight | None = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.quant is not None:
            return self.quant.k, self.quant.n
        assert self.array is not None
        rows, cols = self.array.shape
        return (cols, rows) if self.transposed else (rows, cols)

    def _lines(self) -> tuple[np.ndarray, np.ndarray]:
        if self.quant is not None:
            return quantized_lines(self.quant)
        assert self.array is not None
        return zero_lines(self.value, self.array)

    def zero_rows(self) -> np.ndarray:
        lines = self._lines()
        return lines[1] if self.transposed else lines[0]

    def zero_cols(self) -> np.ndarray:
        lines = self._lines()
        return lines[0] if self.transposed else lines[1]

    def rows(self, index: np.ndarray) -> np.ndarray:
        if self.quant is not None:
            return self.alpha * self.quant.rows(index).astype(np.float64)
        assert self.array is not None
        picked = self.array[:, index].T if self.transposed else self.array[index]
        return self.alpha * picked.astype(np.float64)


def quantized_lines(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(zero rows, zero columns) of a quantized weight, cached on its node for its current inputs."""
    key = tuple(id(v) for v in weight.node.inputs)
    cached = weight.node.meta.get(LINES_META_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    lines = (weight.zero_rows(), weight.zero_cols())
    weight.node.meta[LINES_META_KEY] = (key, lines)
    return lines


def _owned(value: ir.Value | None, reader: ir.Node) -> bool:
    return value is None or (not value.is_graph_output() and {user for user, _ in value.uses()} == {reader})


def quantized_matmul(node: ir.Node | None) -> tuple[ir.Value, QuantizedWeight] | None:
    """``(weight value, weight)`` of a MatMulNBits, or of a MatMul reading a DequantizeLinear of constants as its
    weight, when the node alone reads that weight (a shared one would be duplicated by narrowing it)."""
    if node is None:
        return None
    if is_matmul_nbits(node):
        weight = quantized_weight(node)
        if weight is None or weight.raw["B"].size > MAX_WEIGHT_READ:
            return None
        if not all(_owned(v, node) for v in node.inputs[1:]):
            return None
        return node.inputs[1], weight  # type: ignore[return-value]
    if std(node, "MatMul") and len(node.inputs) == 2 and node.inputs[1] is not None:
        weight = quantized_operand(node.inputs[1])
        if weight is None or weight.raw["x"].size > MAX_WEIGHT_READ or not _owned(node.inputs[1], node):
            return None
        if not all(_owned(v, weight.node) for v in weight.node.inputs):
            return None
        return node.inputs[1], weight
    return None


def set_last_dim(value: ir.Value, size: int) -> None:
    if value.shape is not None and len(value.shape) > 0:
        dims = list(value.shape)
        dims[-1] = size
        value.shape = ir.Shape(dims)


@dataclasses.dataclass
class Linear:
    """``out = x @ W (+ bias)`` along its last axis: a MatMul or Gemm with a constant weight, maybe an Add of a
    constant bias. ``weight`` is the math form ``[in, N]`` (Gemm's ``alpha`` and ``transB`` applied)."""

    node: ir.Node
    weight: Matrix
    bias: np.ndarray | None  # [N], what the output column equals when the weight column is zero
    add: ir.Node | None  # a separate bias Add (its constant operand's index in ``add_index``)
    add_index: int
    out: ir.Value

    @property
    def width(self) -> int:
        return self.weight.shape[1]

    def zero_columns(self) -> np.ndarray:
        return self.weight.zero_cols()

    def column_values(self) -> np.ndarray:
        return np.zeros(self.width) if self.bias is None else self.bias.astype(np.float64)

    def internal(self) -> list[ir.Value]:
        """Values of the leaf whose width changes besides ``out``."""
        return [self.node.outputs[0]] if self.add is not None else []

    def nodes(self) -> list[ir.Node]:
        return [self.node] + ([self.add] if self.add is not None else [])


def bias_vector(array: np.ndarray, width: int) -> np.ndarray | None:
    """A constant that broadcasts as a bias along the last axis of width ``width``, as a [width] vector."""
    if array.size == 1:
        return np.full(width, array.reshape(-1)[0], dtype=np.float64)
    if array.ndim >= 1 and array.shape[-1] == width and array.size == width:
        return array.reshape(-1).astype(np.float64)
    return None


def linear(value: ir.Value) -> Linear | None:
    """The linear leaf computing ``value``, or None."""
    node = value.producer()
    if node is None or len(node.outputs) != 1:
        return None
    if std(node, "Add") and len(node.inputs) == 2:
        for k in (0, 1):  # both operand orders
            inner, bias_value = node.inputs[k], node.inputs[1 - k]
            if inner is None or bias_value is None or len(inner.uses()) != 1 or inner.is_graph_output():
                continue
            base = linear_node(inner)
            bias = const_array(bias_value)
            if base is None or base.bias is not None or bias is None:
                continue
            vector = bias_vector(bias, base.width)
            if vector is None:
                continue
            return dataclasses.replace(base, bias=vector, add=node, add_index=1 - k, out=value)
        return None
    return linear_node(value)


def linear_node(value: ir.Value) -> Linear | None:
    node = value.producer()
    quantized = quantized_matmul(node)
    if quantized is not None:  # MatMulNBits (its bias input 5 included), or MatMul(x, DequantizeLinear(...))
        assert node is not None
        x = node.inputs[0]
        if x is None or x.shape is None or len(x.shape) < 1:
            return None
        weight_value, weight = quantized
        bias = weight.raw.get("bias")
        vector = None if bias is None else bias.reshape(-1).astype(np.float64)
        return Linear(node, Matrix(weight_value, None, quant=weight), vector, None, 0, value)
    if std(node, "MatMul") and len(node.inputs) == 2:
        weight = weight_array(node.inputs[1], own=True)
        x = node.inputs[0]
        if weight is None or x is None or x.shape is None or len(x.shape) < 1:
            return None
        return Linear(node, Matrix(node.inputs[1], weight), None, None, 0, value)
    if std(node, "Gemm") and not node.attributes.get_int("transA", 0):
        raw = weight_array(node.inputs[1], own=True)
        if raw is None:
            return None
        weight = Matrix(node.inputs[1], raw, bool(node.attributes.get_int("transB", 0)))
        alpha, beta = node.attributes.get_float("alpha", 1.0), node.attributes.get_float("beta", 1.0)
        bias = None
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = const_array(node.inputs[2])
            if c is None:
                return None
            bias = bias_vector(c, weight.shape[1])
            if bias is None:
                return None
            bias = beta * bias
        weight.alpha = alpha
        return Linear(node, weight, bias, None, 0, value)
    return None


