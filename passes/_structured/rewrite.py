"""The rewrites of structured zeros: narrowed weights, split sizes, slice bounds and reshape targets."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._builder import Builder
from layerzero.passes._graph import NameFactory, const_array, make_constant
from layerzero.passes._scope import Scopes
from layerzero.passes._structured.chain import Source
from layerzero.passes._structured.leaves import Linear, set_last_dim


class Rewriter:
    """Builds the narrowed weights and the few new nodes (on the passes' builder: model-wide unique names)."""

    def __init__(self, root: ir.Graph, names: NameFactory) -> None:
        self.root = root
        self.names = names
        self.scopes = Scopes(root)
        self.build = Builder(root, names, opset(root))

    def node(
        self, op_type: str, inputs: list[ir.Value], attributes: dict | None = None, *, name: str, output: str
    ) -> ir.Node:
        """A new node, not placed yet (``scopes`` places it), named after ``name``, its output after ``output``."""
        node = self.build.node(op_type, inputs, attributes, name=name)
        self.build.name(node.outputs[0], output)
        return node

    def constant(self, hint: str, array: np.ndarray) -> ir.Value:
        return make_constant(self.root, self.names, f"{hint}_lz_narrowed", np.ascontiguousarray(array))

    def narrow_linear(self, leaf: Linear, columns: np.ndarray) -> int:
        """Keep ``columns`` of the leaf's output; parameters removed."""
        node = leaf.node
        removed = 0
        if leaf.weight.quant is not None:
            # A quantized weight keeps its codes: the output columns are whole rows of its blocks.
            removed += leaf.weight.quant.take_cols(columns, self.constant)
        else:
            raw = const_array(node.inputs[1])
            assert raw is not None
            axis = 0 if node.op_type == "Gemm" and node.attributes.get_int("transB", 0) else 1
            new = np.take(raw, columns, axis=axis)
            removed += raw.size - new.size
            node.replace_input_with(1, self.constant(node.inputs[1].name or "lz_weight", new))
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            c = const_array(node.inputs[2])
            assert c is not None
            if c.size > 1:
                narrowed = np.take(c, columns, axis=-1)
                removed += c.size - narrowed.size
                node.replace_input_with(2, self.constant(node.inputs[2].name or "lz_bias", narrowed))
        set_last_dim(node.outputs[0], len(columns))
        if leaf.add is not None:
            operand = leaf.add.inputs[leaf.add_index]
            bias = const_array(operand)
            assert bias is not None
            if bias.size > 1:
                narrowed = np.take(bias, columns, axis=-1)
                removed += bias.size - narrowed.size
                leaf.add.replace_input_with(leaf.add_index, self.constant(operand.name or "lz_bias", narrowed))
            set_last_dim(leaf.add.outputs[0], len(columns))
        return removed

    def rewrite_pieces(self, source: Source, bounds: list[tuple[int, int]]) -> None:
        done: set[ir.Node] = set()
        for piece, (lo, hi) in zip(source.pieces, bounds):
            node = piece.node
            if node.op_type == "Slice":
                rank = len(node.inputs[0].shape)  # type: ignore[arg-type]
                for k, array in ((1, [lo]), (2, [hi]), (3, [rank - 1]), (4, [1])):
                    value = self.constant(f"{node.name}_bound", np.array(array, np.int64))
                    if k < len(node.inputs):
                        node.replace_input_with(k, value)
                    else:
                        node.resize_inputs(k + 1)
                        node.replace_input_with(k, value)
                set_last_dim(node.outputs[0], hi - lo)
            elif node not in done:
                done.add(node)
                sizes = [end - start for (start, end), p in zip(bounds, source.pieces) if p.node is node]
                if len(node.inputs) > 1 and node.inputs[1] is not None:
                    node.replace_input_with(1, self.constant(f"{node.name}_sizes", np.array(sizes, np.int64)))
                else:
                    node.attributes.pop("num_outputs", None)
                    node.attributes.pop("split", None)
                    if opset(self.root, node) >= 13:
                        node.resize_inputs(2)
                        node.replace_input_with(1, self.constant(f"{node.name}_sizes", np.array(sizes, np.int64)))
                    else:
                        node.attributes.add(ir.AttrInt64s("split", sizes))
                for out, size in zip(node.outputs, sizes):
                    set_last_dim(out, size)

    def reshape_last(self, node: ir.Node, size: int) -> None:
        """The Reshape's target shape with its last size replaced by ``size``."""
        shape = node.inputs[1]
        array = const_array(shape)
        if array is not None:
            new = array.copy()
            new[-1] = size
            node.replace_input_with(1, self.constant(shape.name or "lz_shape", new.astype(np.int64)))
        else:
            head = self.node(
                "Slice",
                [
                    shape,
                    self.constant("lz_zero", np.array([0], np.int64)),
                    self.constant("lz_minus_one", np.array([-1], np.int64)),
                ],
                name=f"{node.name}_lz_head",
                output=f"{node.name}_lz_head",
            )
            concat = self.node(
                "Concat",
                [head.outputs[0], self.constant("lz_size", np.array([size], np.int64))],
                {"axis": 0},
                name=f"{node.name}_lz_shape",
                output=f"{node.name}_lz_shape",
            )
            self.scopes.insert_before(node, [head, concat])
            node.replace_input_with(1, concat.outputs[0])
        set_last_dim(node.outputs[0], size)


def opset(root: ir.Graph, node: ir.Node | None = None) -> int:
    """The default-domain opset of ``root``'s imports (13 when it names none)."""
    model_opsets = root.opset_imports
    return int(model_opsets.get("", model_opsets.get("ai.onnx", 13)))


