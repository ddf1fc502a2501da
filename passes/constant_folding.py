"""Constant folding: evaluate nodes whose inputs are all constants; inline `If` on a constant condition."""

from __future__ import annotations

import collections
import logging

import numpy as np
import onnx
import onnx_ir as ir

from layerzero.ort_runner import create_session
from layerzero.passes._graph import (
    NameFactory,
    const_array,
    make_constant,
    release_subgraphs,
    replace_value,
)
from layerzero.passes._scope import Scopes

__all__ = ["FoldConstants"]

logger = logging.getLogger(__name__)

# Ops whose result is not a function of their inputs, or that we must not evaluate ahead of time.
_NON_DETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
# Element types whose folding would not round the way ORT's own run of the original does (Case 1).
_LOW_PRECISION = frozenset(
    {
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
        ir.DataType.FLOAT8E4M3FN,
        ir.DataType.FLOAT8E4M3FNUZ,
        ir.DataType.FLOAT8E5M2,
        ir.DataType.FLOAT8E5M2FNUZ,
    }
)
# Ops we never fold, because their output would be large or their folding gains nothing. DequantizeLinear: a
# quantized weight stays quantized (ONNX Runtime fuses DQ -> MatMul into MatMulNBits, whose arithmetic a folded
# float weight would not reproduce); the zeroing passes read it through passes/_quantized.py.
_NEVER_FOLD = frozenset(
    {"Constant", "ConstantOfShape", "Loop", "Scan", "SequenceConstruct", "Optional", "DequantizeLinear"}
)



def _element_count(value: ir.Value) -> int | None:
    """The element count of a constant's tensor (or of a value's static shape), from the shape alone: None when
    not known without reading the data."""
    tensor = value.const_value
    shape = tensor.shape if tensor is not None else value.shape
    if shape is None:
        return None
    dims = list(shape)
    if not all(isinstance(d, int) for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64)) if dims else 1

class FoldConstants(ir.passes.InPlacePass):
    """Fold computation whose inputs are known at compile time.

    Cases:
    1. A default-domain node whose inputs are all constants (initializers not also graph inputs, Constant
       nodes, or outputs of nodes folded in the same run) and whose outputs have at most ``max_elements``
       elements each: evaluated with onnxruntime, the runtime the compiled model runs on (``onnx.reference``
       differs from it on some ops, e.g. ``LpNormalization`` p=1), and replaced by initializers. All the
       foldable nodes of one graph are evaluated in one ORT session per pass run; when that session
       cannot be made (an op or type ORT lacks), each node is tried alone and those ORT refuses stay.
       Nodes that read or make float16 / bfloat16 / float8 values are left to ORT (it rounds such chains its
       own way at load time).
    2. ``Shape`` / ``Size`` of a value whose shape is fully static: replaced by the constant.
    3. ``If`` whose condition is a constant: the taken branch's nodes move into the enclosing graph
       and its outputs replace the ``If``'s outputs (nested Ifs fold on the same run).
    Subgraphs are visited. An initializer that is also a graph input can be overridden at run time: it is
    never a constant (``const_array``).
    """

    def __init__(self, max_elements: int = 1 << 20) -> None:
        super().__init__()
        self.max_elements = max_elements

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        root = model.graph
        names = NameFactory(root)
        opsets = dict(model.opset_imports)
        scopes = Scopes(root)
        modified = False
        for graph in list(model.graphs()):
            # Fold, then inline the Ifs whose condition that made constant, then fold what they brought along.
            while True:
                modified |= self._fold_graph(root, graph, names, opsets)
                if not self._fold_ifs(graph, names, scopes):
                    break
                modified = True
        return ir.passes.PassResult(model, modified=modified)

    # Case 3, over a FIFO (no quadratic pop(0)): a nested If an inlined branch brings along folds on this run.
    def _fold_ifs(self, graph: ir.Graph, names: NameFactory, scopes: Scopes) -> bool:
        pending = collections.deque(node for node in graph if node.op_type == "If")
        inlined_any = False
        while pending:
            node = pending.popleft()
            if node.graph is not graph or node.domain not in ("", "ai.onnx"):
                continue
            inlined = self._fold_if(graph, node, names, scopes)
            if inlined is not None:
                inlined_any = True
                pending.extend(n for n in inlined if n.op_type == "If")
        return inlined_any

    # Case 1 and 2
    def _foldable(self, node: ir.Node) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD | _NON_DETERMINISTIC:
            return False
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return False
        if any(out.type is not None and not isinstance(out.type, ir.TensorType) for out in node.outputs):
            return False  # sequences and optionals have no initializer form
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            return False  # dead: DCE's job
        if any(v is not None and v.dtype in _LOW_PRECISION for v in (*node.inputs, *node.outputs)):
            # NOTE: ORT computes low-precision chains with its own up-casts and fusions (InsertCastTransformer):
            # a value folded op by op rounds differently (1-2 fp16 ulps, the backend attention tests). Left to it.
            return False
        # Already folded: Identity(constant) is how a graph output keeps its name (replace_value).
        return not (node.op_type == "Identity" and node.outputs[0].is_graph_output())

    def _fold_graph(self, root: ir.Graph, graph: ir.Graph, names: NameFactory, opsets: dict[str, int]) -> bool:
        known: dict[int, np.ndarray] = {}  # id(value) -> its constant contents (Case 2 results, constant inputs)
        batch: list[ir.Node] = []
        produced: set[int] = set()
        static: dict[ir.Value, np.ndarray] = {}
        for node in graph:
            if not self._foldable(node):
                continue
            shape_fold = self._static_shape_fold(node)
            if shape_fold is not None:  # Case 2
                static[node.outputs[0]] = shape_fold[0]
                continue
            inputs_ok = True
            size = 0
            for value in node.inputs:
                if value is None or id(value) in produced:
                    continue
                if value in static:
                    array = static[value]
                elif id(value) in known:
                    array = known[id(value)]
                else:
                    count = _element_count(value)
                    if count is not None and size + count > self.max_elements:
                        inputs_ok = False  # too large to fold: never read (a MoE's expert stack is GBs)
                        break
                    array = const_array(value)
                    if array is None:
                        inputs_ok = False
                        break
                    known[id(value)] = array
                size += array.size
            if not inputs_ok or size > self.max_elements:
                continue
            if all(v is None for v in node.inputs):
                continue  # a source op with only attributes (e.g. Range needs inputs): nothing to fold from
            batch.append(node)
            produced.update(id(out) for out in node.outputs)
        results: dict[ir.Value, np.ndarray] = dict(static)
        if batch:
            for value in static:
                known[id(value)] = static[value]
            results.update(self._evaluate(batch, known, opsets))
        modified = False
        in_batch = set(batch)
        for value, array in results.items():
            # Replace only what a node outside the folded set reads, or a graph output.
            needed = value.is_graph_output() or any(use.node not in in_batch for use in value.uses())
            if not needed or array.size > self.max_elements:
                continue
            if value.dtype is not None and array.dtype != value.dtype.numpy():
                try:
                    array = array.astype(value.dtype.numpy())
                except Exception:
                    continue
            const = make_constant(root, names, value.name or "folded", array)
            if value.type is not None:
                const.type = value.type
            replace_value(value, const, names)
            modified = True
        return modified

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

    def _evaluate(
        self,
        batch: list[ir.Node],
        known: dict[int, np.ndarray],
        opsets: dict[str, int],
    ) -> dict[ir.Value, np.ndarray]:
        """The outputs of ``batch`` (topologically ordered), computed by onnxruntime.

        One session for the whole batch; when ORT refuses it, one session per node, feeding results forward
        (a node ORT refuses, and whatever reads it, is left alone).
        """
        try:
            return _run_ort(batch, known, opsets)
        except Exception as exc:
            logger.debug("batched folding failed (%s); folding node by node", str(exc).splitlines()[0][:200])
        results: dict[ir.Value, np.ndarray] = {}
        for node in batch:
            feeds = {}
            for value in node.inputs:
                if value is None:
                    continue
                if value in results:
                    feeds[id(value)] = results[value]
                elif id(value) in known:
                    feeds[id(value)] = known[id(value)]
                else:
                    break  # its producer could not be folded
            else:
                try:
                    results.update(_run_ort([node], feeds, opsets))
                except Exception as exc:
                    logger.debug("could not fold %s (%s): %s", node.name, node.op_type, str(exc).splitlines()[0])
        return results

    # Case 3
    def _fold_if(self, graph: ir.Graph, node: ir.Node, names: NameFactory, scopes: Scopes) -> list[ir.Node] | None:
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
        for name, init in list(branch.initializers.items()):
            branch.initializers.pop(name)
            init.name = names(name)
            graph.register_initializer(init)
        # The body reads what the branch saw: values computed before the If, and its own initializers (moved first).
        scopes.insert_before(node, body)
        branch_outputs = list(branch.outputs)
        branch.outputs.clear()  # first, so that a branch output may take the If output's name
        for if_out, branch_out in zip(node.outputs, branch_outputs):
            replace_value(if_out, branch_out, names)
        if not any(if_out.uses() or if_out.is_graph_output() for if_out in node.outputs):
            # The untaken branch still reads outer values: release them, or their producers look used.
            release_subgraphs(node)
            graph.remove(node, safe=True)
        return body


def _run_ort(nodes: list[ir.Node], known: dict[int, np.ndarray], opsets: dict[str, int]) -> dict[ir.Value, np.ndarray]:
    """Evaluate ``nodes`` (topologically ordered) with onnxruntime; their inputs are ``known`` constants."""
    local: dict[int, str] = {}

    def name(value: ir.Value) -> str:
        if id(value) not in local:
            local[id(value)] = f"v{len(local)}"
        return local[id(value)]

    protos = []
    outputs: list[ir.Value] = []
    produced: set[int] = set()
    for node in nodes:
        inputs = ["" if v is None else name(v) for v in node.inputs]
        # An unnamed output is an omitted optional one: asking for it could change what the op computes.
        outs = [name(v) if v.name else "" for v in node.outputs]
        proto = onnx.helper.make_node(node.op_type, inputs, outs, domain="")
        proto.attribute.extend(ir.serde.serialize_attribute(a) for a in node.attributes.values())
        protos.append(proto)
        outputs.extend(v for v in node.outputs if v.name)
        produced.update(id(v) for v in node.outputs)
    initializers = [
        onnx.numpy_helper.from_array(np.asarray(known[key]), local[key])
        for key in list(local)
        if key not in produced and key in known
    ]
    missing = [key for key in local if key not in produced and key not in known]
    if missing:
        raise ValueError("an input of the folded nodes has no constant value")
    version = opsets.get("", opsets.get("ai.onnx", 18))
    graph = onnx.helper.make_graph(
        protos, "fold", [], [onnx.ValueInfoProto(name=local[id(v)]) for v in outputs], initializers
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", version)], ir_version=10)
    # The kernels themselves: graph optimisations of a fold model gave values of another shape (a [1] where
    # Range needs a scalar: the backend affine_grid tests). Default-domain ops only: no custom-op library.
    session = create_session(
        model.SerializeToString(),
        libraries=(),
        graph_optimization_level="disable",
        intra_op_num_threads=1,
        inter_op_num_threads=1,
        log_severity_level=4,
        label="the constant-folding batch",
    )
    arrays = session.run(None, {})
    result = {}
    for value, array in zip(outputs, arrays):
        if isinstance(array, np.ndarray | np.generic):
            result[value] = np.asarray(array)
    return result
