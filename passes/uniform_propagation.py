"""Uniform and row-constant propagation: `x*0`, `x @ 0 + b`, `Cos(0)`, identities, through dynamic shapes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._graph import NameFactory, const_array, make_constant, replace_value
from layerzero.passes._lattice import is_true, is_zero, transfer, uniform_of_constant
from layerzero.passes._rows import MAX_ROW_ELEMENTS, transfer_row
from layerzero.passes._scope import Scopes
from layerzero.passes._shapes import SymbolicShapes

__all__ = ["IDENTITIES", "Identity", "PropagateUniforms"]

logger = logging.getLogger(__name__)

_CANONICAL = frozenset({"Constant", "ConstantOfShape"})
# Consumers that broadcast their operands: a row is read by them as an initializer (Case 4).
_BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Equal", "Greater", "Less", "And", "Or"}
)
# Constants up to this many elements are read for the row transfers (weights met by a row included).
_MAX_CONSTANT_READ = 1 << 24


def _is_one(c: np.ndarray | None) -> bool:
    return c is not None and c.dtype != np.bool_ and bool(c == 1)


def _always(c: np.ndarray | None) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Identity:
    """``op``'s output is its input ``result`` when input ``operand`` is a uniform with ``test`` (Case 2).

    ``operand`` None: always (the data-movement ops, when shape and dtype are kept). The rewrite also needs the
    output's shape and dtype to equal that input's (broadcasting keeps x), checked by the pass."""

    op: str
    operand: int | None
    test: Callable[[np.ndarray | None], bool]
    result: int


def _both_orders(op: str, test: Callable[[np.ndarray | None], bool]) -> tuple[Identity, Identity]:
    """The identity with the constant second, then first (the op commutes)."""
    return Identity(op, 1, test, 0), Identity(op, 0, test, 1)


# One row per identity, tried in order (the first that holds wins). Adding an op's identity is one row.
IDENTITIES: tuple[Identity, ...] = (
    *_both_orders("Add", is_zero),  # x + 0 -> x, 0 + x -> x
    Identity("Sub", 1, is_zero, 0),  # x - 0 -> x
    *_both_orders("Mul", _is_one),  # x * 1 -> x, 1 * x -> x
    Identity("Div", 1, _is_one, 0),  # x / 1 -> x
    Identity("Pow", 1, _is_one, 0),  # x ** 1 -> x
    Identity("Where", 0, is_true, 1),  # Where(true, x, y) -> x
    Identity("Where", 0, is_zero, 2),  # Where(false, y, x) -> x
    *_both_orders("And", is_true),  # x and true -> x, true and x -> x
    *_both_orders("Or", is_zero),  # x or false -> x, false or x -> x
    Identity("Reshape", None, _always, 0),  # Reshape(x, shape of x) -> x
    Identity("Expand", None, _always, 0),  # Expand(x, shape of x) -> x
    Identity("Cast", None, _always, 0),  # Cast(x, to its own dtype) -> x
    Identity("Identity", None, _always, 0),  # Identity(x) -> x
    Identity("CastLike", None, _always, 0),  # CastLike(x, a value of its dtype) -> x
)
_IDENTITIES_BY_OP: dict[str, tuple[Identity, ...]] = {}
for _rule in IDENTITIES:
    _IDENTITIES_BY_OP[_rule.op] = (*_IDENTITIES_BY_OP.get(_rule.op, ()), _rule)


class PropagateUniforms(ir.passes.InPlacePass):
    """Track which values are uniform (every element equal) or rows, and rewrite what that proves.

    Shapes come from the node's own operands (``passes/_shapes.py``): the op's shape rule over the
    operands' dims and the contents of ``Shape``-built shape tensors, merged with inference's names.
    TorchScript exports name almost no intermediate dim; nothing below depends on dim names.

    Cases:
    1. A uniform value that a surviving consumer reads is materialised as
       ``ConstantOfShape(shape)``: the shape is static, or built from ``Shape`` of values that carry
       its dims at run time (graph inputs first, else computed values before it that stay), so the
       value keeps its (dynamic) shape. Its producer chain dies. Uniform sources: all-equal
       constants (including all-zero weights) and ConstantOfShape. No carrier: logged, kept.
    2. An op whose output provably equals one input is bypassed (the table ``IDENTITIES``): ``x + 0``,
       ``0 + x``, ``x - 0``, ``x * 1``, ``1 * x``, ``x / 1``, ``x ** 1``, ``Where(true, x, y)``,
       ``Where(false, y, x)``, ``x and true``, ``x or false``; and Reshape/Expand/Cast/Identity/CastLike that
       keep shape and dtype. Only when the output's dtype and shape provably equal the input's (broadcasting
       keeps x).
    3. ``x * 0``, ``MatMul(x, 0)``, ``Gemm``/``Conv`` with zero weights and Einsum with a zero
       operand are 0 only when x is finite: they fold under ``assume_finite`` (default on).
    4. Row constants (``x @ 0 + b``, ``act(row)``, ``MatMul(row, W)``, norms, a cached table of equal
       rows; ``passes/_rows.py``): a consumer that broadcasts reads the row as an initializer
       (``residual + row`` is one Add); any other consumer or a graph output reads
       ``Expand(row, shape)``. The row's producer chain dies.
    Transfer functions: ``passes/_lattice.py`` (uniforms), ``passes/_rows.py`` (rows). Subgraphs are
    visited.
    """

    def __init__(self, assume_finite: bool = True) -> None:
        super().__init__()
        self.assume_finite = assume_finite

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        root = model.graph
        names = NameFactory(root)
        graphs = list(model.graphs())
        shapes = SymbolicShapes(root, graphs)
        use_shape_range = dict(model.opset_imports).get("", 18) >= 15
        scopes = Scopes(root)
        modified = False
        for graph in graphs:
            build = Builder(root, names, model_opset(model))
            rewriter = _GraphRewriter(graph, build, shapes, self.assume_finite, use_shape_range, scopes)
            modified |= rewriter.run()
        return ir.passes.PassResult(model, modified=modified)


class _GraphRewriter:
    def __init__(
        self,
        graph: ir.Graph,
        build: Builder,
        shapes: SymbolicShapes,
        assume_finite: bool,
        use_shape_range: bool,
        scopes: Scopes,
    ) -> None:
        self.graph = graph
        self.build = build  # the new nodes' builder (model-wide unique names); they are placed by ``scopes``
        self.root = build.root
        self.scopes = scopes
        self.names = build.names
        self.shapes = shapes
        self.position = {node: i for i, node in enumerate(graph)}
        self.assume_finite = assume_finite
        self.use_shape_range = use_shape_range
        self.uniform: dict[ir.Value, np.ndarray] = {}
        self.rows: dict[ir.Value, np.ndarray] = {}
        self.alias: dict[ir.Value, ir.Value] = {}
        self._shape_cache: dict[tuple, ir.Value] = {}

    def state(self, value: ir.Value | None) -> np.ndarray | None:
        if value is None:
            return None
        if value in self.uniform:
            return self.uniform[value]
        return uniform_of_constant(value)

    def run(self) -> bool:
        nodes = list(self.graph)
        for node in nodes:
            ins = [self.state(v) for v in node.inputs]
            target = self._alias_target(node, ins)
            if target is not None:
                self.alias[node.outputs[0]] = target
                c = self.state(target)
                if c is not None:
                    self.uniform[node.outputs[0]] = c
                elif target in self.rows:
                    self.rows[node.outputs[0]] = self.rows[target]
                continue
            found = False
            for out, c in zip(node.outputs, transfer(node, ins, assume_finite=self.assume_finite)):
                if c is not None and out.shape is not None and out.dtype is not None:
                    self.uniform[out] = c
                    found = True
            if not found and (
                any(c is not None for c in ins)
                or any(v in self.rows for v in node.inputs)
                or (node.op_type in ("Gather", "GatherND") and self._small_constant(node.inputs[0]))
            ):
                self._transfer_rows(node)  # Case 4
        modified = False
        for node in nodes:  # Case 2
            out = node.outputs[0] if node.outputs else None
            if out is not None and out in self.alias and (out.uses() or out.is_graph_output()):
                replace_value(out, self._resolve(out), self.names)
                modified = True
        for node in nodes:  # Case 4: rows that a consumer reads
            for out in node.outputs:
                if out in self.rows and self._needs_materialising(out):
                    modified |= self._materialise_row(node, out)
        for node in nodes:  # Case 1
            for out in node.outputs:
                if out in self.uniform and self._needs_materialising(out):
                    modified |= self._materialise(node, out)
        return modified

    # Case 4
    def _row_state(self, value: ir.Value | None) -> np.ndarray | None:
        if value is None:
            return None
        if value in self.rows:
            return self.rows[value]
        c = self.state(value)
        if c is not None:
            return np.asarray(c)
        tensor = value.const_value
        if tensor is not None and tensor.size > _MAX_CONSTANT_READ:
            return None  # a huge weight is not read (memory-mapped pages stay cold)
        return const_array(value)  # an initializer or a Constant node

    @staticmethod
    def _small_constant(value: ir.Value | None) -> bool:
        """A constant small enough to be a cached table (Case 5 of passes/_rows.py), not an embedding."""
        if value is None or value.is_graph_input():
            return False
        tensor = value.const_value
        if tensor is None:
            producer = value.producer()
            if producer is None or producer.op_type != "Constant":
                return False
            tensor = ir.convenience.get_const_tensor(value)
        return tensor is not None and tensor.size <= MAX_ROW_ELEMENTS

    def _transfer_rows(self, node: ir.Node) -> None:
        ins = [self._row_state(v) for v in node.inputs]

        def rank_of(value: ir.Value) -> int | None:
            dims = self.shapes.dims(value)
            return None if dims is None else len(dims)

        rows = transfer_row(node, ins, rank_of, self.shapes.dims, assume_finite=self.assume_finite)
        for out, row in zip(node.outputs, rows):
            if row is None or row.size == 0 or out.shape is None:
                continue
            flat = row.reshape(-1)
            if np.all(flat == flat[0]):
                self.uniform[out] = flat[0].copy()  # a row of equal elements is a uniform
            else:
                self.rows[out] = row

    def _broadcast_keeps(self, user: ir.Node, index: int, row: np.ndarray) -> bool:
        """True when ``user`` broadcasts its operand ``index`` and ``row`` in its place keeps the output shape."""
        if user.domain not in ("", "ai.onnx") or user.op_type not in _BROADCASTING or len(user.outputs) != 1:
            return False
        operands = [list(row.shape) if k == index else self.shapes.dims(v) for k, v in enumerate(user.inputs)]
        if any(v is None for v in user.inputs):
            return False
        out = self.shapes.dims(user.outputs[0])
        return out is not None and self.shapes.broadcast(operands) == out

    def _materialise_row(self, producer: ir.Node, value: ir.Value) -> bool:
        """``residual + row`` reads the row as an initializer; elsewhere ``Expand(row, shape)``."""
        row = self.rows[value]
        dtype = value.dtype.numpy() if value.dtype is not None else row.dtype
        constant: ir.Value | None = None
        modified = False
        rest = value.is_graph_output()
        for user, index in list(value.uses()):
            if self._covered(user):
                continue
            if self._broadcast_keeps(user, index, row):
                # before: y = Add(residual, row_value)   after: y = Add(residual, <initializer R>)
                if constant is None:
                    constant = make_constant(self.root, self.names, f"{value.name}_row", row.astype(dtype))
                user.replace_input_with(index, constant)
                modified = True
            else:
                rest = True
        if not rest:
            return modified
        dims = self._shape_dims(value, producer)
        if dims is None:
            logger.debug("row %s: no operand carries its shape %s at run time", value.name, value.shape)
            return modified
        if constant is None:
            constant = make_constant(self.root, self.names, f"{value.name}_row", row.astype(dtype))
        shape = self._shape_tensor(dims, producer)
        return self._replace_by(value, self.build.node("Expand", [constant, shape], name="lz_row"), producer, "row")

    def _replace_by(self, value: ir.Value, node: ir.Node, before: ir.Node, suffix: str) -> bool:
        """Place ``node`` before ``before``; ``value``'s readers read its output (``<value>_<suffix>``, with
        ``value``'s shape and type) instead."""
        new = self.build.name(node.outputs[0], f"{value.name}_{suffix}")
        new.shape, new.type = value.shape, value.type
        self.scopes.insert_before(before, node)
        replace_value(value, new, self.names)
        return True

    def _resolve(self, value: ir.Value) -> ir.Value:
        while value in self.alias:
            value = self.alias[value]
        return value

    # Case 2
    def _alias_target(self, node: ir.Node, ins: list[np.ndarray | None]) -> ir.Value | None:
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        inputs = node.inputs
        candidate: ir.Value | None = None
        for rule in _IDENTITIES_BY_OP.get(node.op_type, ()):
            if rule.result < len(inputs) and (
                rule.operand is None or (rule.operand < len(ins) and rule.test(ins[rule.operand]))
            ):
                candidate = inputs[rule.result]
                break
        if candidate is None:
            return None
        candidate = self._resolve(candidate)
        out = node.outputs[0]
        if out.is_graph_output() and node.op_type == "Identity":
            return None  # a graph output keeps its name through an Identity: nothing to gain
        return candidate if self.shapes.same_shape(out, candidate) else None

    # Case 1
    def _canonical(self, value: ir.Value) -> bool:
        if value.is_initializer() or value.const_value is not None:
            return True
        producer = value.producer()
        if producer is None:
            return True  # graph input
        if producer.op_type in _CANONICAL:
            return True
        return producer.op_type == "Identity" and bool(producer.inputs) and self._canonical(producer.inputs[0])

    def _covered(self, node: ir.Node) -> bool:
        """True when every used output of ``node`` is rewritten away in this graph."""
        if node.graph is not self.graph:
            return False
        for out in node.outputs:
            if not (out.uses() or out.is_graph_output()):
                continue
            if out in self.alias:
                continue
            if out in self.uniform and self._shape_dims(out, node) is not None:
                continue
            if out in self.rows:
                continue
            return False
        return True

    def _needs_materialising(self, value: ir.Value) -> bool:
        if (value not in self.uniform and value not in self.rows) or self._canonical(value):
            return False
        if value.is_graph_output():
            return True
        return any(not self._covered(user) for user, _ in value.uses())

    def _shape_dims(self, value: ir.Value, anchor: ir.Node) -> list[int | tuple[ir.Value, int]] | None:
        """Static sizes, or (value, axis) carriers of each dim that exist before ``anchor`` at run time."""
        dims = self.shapes.dims(value)
        if dims is None:
            return None
        out: list[int | tuple[ir.Value, int]] = []
        for dim in dims:
            if isinstance(dim, int):
                out.append(dim)
                continue
            carrier = next((c for c in self.shapes.carriers(dim) if self._available(c[0], anchor)), None)
            if carrier is None:
                return None
            out.append(carrier)
        return out

    def _available(self, value: ir.Value, anchor: ir.Node) -> bool:
        """True when ``value`` is computed before ``anchor`` and stays computed (not folded away)."""
        if value.is_graph_input():
            return value.graph is self.root or value.graph is self.graph
        if value.is_initializer():
            return False  # static sizes are ints already
        producer = value.producer()
        if producer is None or producer.graph is not self.graph or value in self.alias:
            return False
        if (value in self.uniform or value in self.rows) and not self._canonical(value):
            return False  # Shape() of it would keep the computation we are removing alive
        index = self.position.get(producer)
        return index is not None and index < self.position.get(anchor, -1)

    def _shape_tensor(self, dims: list[int | tuple[ir.Value, int]], before: ir.Node) -> ir.Value:
        """The shape tensor of ``dims``, computed before ``before`` (a cached one when it is, Case 4's rows and
        Case 1's uniforms are materialised in two sweeps: a shape made for a later node is not reused earlier)."""
        key = tuple(d if isinstance(d, int) else (id(d[0]), d[1]) for d in dims)
        cached = self._shape_cache.get(key)
        if cached is not None and self.scopes.visible(cached, before):
            return cached
        if all(isinstance(d, int) for d in dims):
            shape = make_constant(self.root, self.names, "lz_shape", np.array(dims, dtype=np.int64))
            self._shape_cache[key] = shape
            return shape
        pieces: list[ir.Value] = []
        new_nodes: list[ir.Node] = []
        pending: list[int] = []
        for d in dims:
            if isinstance(d, int):
                pending.append(d)
                continue
            if pending:
                pieces.append(make_constant(self.root, self.names, "lz_dims", np.array(pending, np.int64)))
                pending = []
            source, axis = d
            if self.use_shape_range:
                node = self.build.node(
                    "Shape", [source], {"start": axis, "end": axis + 1}, name=f"{source.name}_dim{axis}"
                )
            else:
                full = self.build.node("Shape", [source], name=f"{source.name}_shape")
                index = make_constant(self.root, self.names, "lz_axis", np.array([axis], np.int64))
                new_nodes.append(full)
                node = self.build.node("Gather", [full.outputs[0], index], name="lz_gather_dim")
            self.build.name(node.outputs[0], f"{source.name}_dim{axis}")
            new_nodes.append(node)
            pieces.append(node.outputs[0])
        if pending:
            pieces.append(make_constant(self.root, self.names, "lz_dims", np.array(pending, np.int64)))
        if len(pieces) == 1:
            shape = pieces[0]
        else:
            concat = self.build.node("Concat", pieces, {"axis": 0}, name="lz_shape")
            self.build.name(concat.outputs[0], "lz_shape")
            new_nodes.append(concat)
            shape = concat.outputs[0]
        self.scopes.insert_before(before, new_nodes)
        self._shape_cache[key] = shape
        return shape

    def _materialise(self, producer: ir.Node, value: ir.Value) -> bool:
        dims = self._shape_dims(value, producer)
        if dims is None:
            logger.debug("uniform %s: no operand carries its shape %s at run time", value.name, value.shape)
            return False
        c = self.uniform[value]
        # Insert before the first node of this graph, so the shape pieces (graph inputs) dominate.
        anchor = producer
        shape = self._shape_tensor(dims, anchor)
        fill = ir.tensor(np.asarray(c).reshape(1))
        node = self.build.node("ConstantOfShape", [shape], {"value": fill}, name="lz_uniform")
        return self._replace_by(value, node, anchor, "uniform")
