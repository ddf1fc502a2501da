"""Constant folding: evaluate nodes whose inputs are all constants; inline `If` on a constant condition."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from layerzero.passes._graph import (
    NameFactory,
    const_array,
    iter_graphs,
    make_constant,
    release_subgraphs,
    replace_value,
)

__all__ = ["FoldConstants"]

logger = logging.getLogger(__name__)

# Ops whose result is not a function of their inputs, or that we must not evaluate ahead of time.
_NON_DETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
# Ops we never fold, because their output would be large or their folding gains nothing.
_NEVER_FOLD = frozenset({"Constant", "ConstantOfShape", "Loop", "Scan", "SequenceConstruct", "Optional"})


class FoldConstants(ir.passes.InPlacePass):
    """Fold computation whose inputs are known at compile time.

    Cases:
    1. A default-domain node whose inputs are all constants (initializers not also graph inputs, or
       Constant nodes) and whose outputs have at most ``max_elements`` elements each: evaluated with
       the ONNX reference evaluator and replaced by initializers.
    2. ``Shape`` / ``Size`` of a value whose shape is fully static: replaced by the constant.
    3. ``If`` whose condition is a constant: the taken branch's nodes move into the enclosing graph
       and its outputs replace the ``If``'s outputs (nested Ifs fold on the next iteration).
    Subgraphs are visited. Nodes that fail to evaluate are left alone (logged at DEBUG).
    """

    def __init__(self, max_elements: int = 1 << 20) -> None:
        super().__init__()
        self.max_elements = max_elements

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        root = model.graph
        names = NameFactory(root)
        opsets = dict(model.opset_imports)
        modified = False
        for graph in list(iter_graphs(root)):
            pending = list(graph)
            while pending:
                node = pending.pop(0)
                if node.graph is not graph:  # moved or removed by an earlier fold
                    continue
                if node.op_type == "If" and node.domain in ("", "ai.onnx"):
                    inlined = self._fold_if(graph, node, names)
                    if inlined is not None:
                        modified = True
                        pending[:0] = inlined  # a nested If (Case 3) folds on this same run
                    continue
                modified |= self._fold_node(root, node, names, opsets)
        return ir.passes.PassResult(model, modified=modified)

    # Case 1 and 2
    def _fold_node(self, root: ir.Graph, node: ir.Node, names: NameFactory, opsets: dict[str, int]) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD | _NON_DETERMINISTIC:
            return False
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return False
        if any(out.type is not None and not isinstance(out.type, ir.TensorType) for out in node.outputs):
            return False  # sequences and optionals have no initializer form
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            return False  # dead: DCE's job
        if node.op_type == "Identity" and node.outputs[0].is_graph_output():
            # Already folded: Identity(constant) is how a graph output keeps its name (replace_value).
            return False
        results = self._static_shape_fold(node)
        if results is None:
            results = self._evaluate(node, opsets)
        if results is None:
            return False
        if any(r.size > self.max_elements for r in results):
            return False
        for out, array in zip(node.outputs, results):
            const = make_constant(root, names, out.name or "folded", array)
            if out.type is not None:
                const.type = out.type
            replace_value(out, const, names)
        return True

    @staticmethod
    def _static_shape_fold(node: ir.Node) -> list[np.ndarray] | None:
        # Case 2
        if node.op_type not in ("Shape", "Size") or not node.inputs or node.inputs[0] is None:
            return None
        shape = node.inputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        dims = [int(d) for d in shape]
        if node.op_type == "Size":
            return [np.array(int(np.prod(dims)), dtype=np.int64)]
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", len(dims))
        return [np.array(dims[slice(start, end)], dtype=np.int64)]

    def _evaluate(self, node: ir.Node, opsets: dict[str, int]) -> list[np.ndarray] | None:
        inputs: list[np.ndarray | None] = []
        for value in node.inputs:
            if value is None:
                inputs.append(None)
                continue
            array = const_array(value)
            if array is None:
                return None
            inputs.append(array)
        if all(x is None for x in inputs) and node.op_type != "Range":
            # Nothing to fold from (e.g. a source op with only attributes we do not handle).
            return None
        if sum(x.size for x in inputs if x is not None) > self.max_elements:
            return None
        in_names = [f"i{k}" if x is not None else "" for k, x in enumerate(inputs)]
        out_names = [f"o{k}" if out.name is not None else "" for k, out in enumerate(node.outputs)]
        proto = onnx.helper.make_node(node.op_type, in_names, out_names, domain="")
        proto.attribute.extend(ir.serde.serialize_attribute(a) for a in node.attributes.values())
        feeds = {n: x for n, x in zip(in_names, inputs) if n}
        try:
            from onnx.reference import ReferenceEvaluator

            version = node.version or opsets.get("", opsets.get("ai.onnx", 18))
            evaluator = ReferenceEvaluator(proto, opsets={"": version})
            results = evaluator.run(None, feeds)
        except Exception as exc:  # the reference evaluator lacks some ops / edge cases
            logger.debug("could not fold %s (%s): %s", node.name, node.op_type, exc)
            return None
        if not all(isinstance(r, np.ndarray | np.generic) for r in results):
            return None  # a sequence, optional or map: only tensors become initializers
        arrays = [np.asarray(r) for r in results]
        for k, (out, array) in enumerate(zip(node.outputs, arrays)):
            if out.dtype is not None and array.dtype != out.dtype.numpy():
                try:
                    arrays[k] = array.astype(out.dtype.numpy())
                except Exception:
                    return None
        return arrays

    # Case 3
    def _fold_if(self, graph: ir.Graph, node: ir.Node, names: NameFactory) -> list[ir.Node] | None:
        """The nodes inlined into ``graph`` (None when the condition is not a constant)."""
        cond = const_array(node.inputs[0])
        if cond is None or cond.size != 1:
            return None
        branch_name = "then_branch" if bool(cond.reshape(())) else "else_branch"
        branch = node.attributes[branch_name].value
        body = list(branch)
        for inner in body:
            branch.remove(inner)
            for out in inner.outputs:
                if out.name:
                    out.name = names(out.name)
            if inner.name:
                inner.name = names(inner.name)
        graph.insert_before(node, body)
        for name, init in list(branch.initializers.items()):
            branch.initializers.pop(name)
            init.name = names(name)
            graph.register_initializer(init)
        branch_outputs = list(branch.outputs)
        branch.outputs.clear()  # first, so that a branch output may take the If output's name
        for if_out, branch_out in zip(node.outputs, branch_outputs):
            replace_value(if_out, branch_out, names)
        if not any(if_out.uses() or if_out.is_graph_output() for if_out in node.outputs):
            # The untaken branch still reads outer values: release them, or their producers look used.
            release_subgraphs(node)
            graph.remove(node, safe=True)
        return body
