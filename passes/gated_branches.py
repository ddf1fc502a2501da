"""Gated branches: ``y = x + g * f(x)`` with a gate computed at run time runs ``f`` only where ``g`` is on."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import onnx_ir as ir

from layerzero.contract import REFUSED_META_KEY
from layerzero.passes._builder import Builder
from layerzero.passes._dynamic import (
    MASK_PREFIX,
    DynamicPath,
    read_dynamic_paths,
    record_dynamic_path,
    threshold_input,
)
from layerzero.passes._graph import (
    NAME_SCOPES_KEY,
    NameFactory,
    common_scope,
    const_array,
    read_round_trip_sources,
    rename_output,
    same_dim,
    same_shape,
    scope_of,
)
from layerzero.passes._layers import describe_value, layer_params
from layerzero.passes._match import Refusal

__all__ = ["REFUSED_META_KEY", "SkipGatedBranches", "read_refused_branches"]

logger = logging.getLogger(__name__)


_ONNX = ("", "ai.onnx")
_MS = "com.microsoft"

# Ops that compute each element from the same element of their inputs (broadcast on the side).
_ELEMENTWISE = frozenset(
    {
        "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitwiseAnd", "BitwiseNot",
        "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Dropout",
        "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish",
        "Identity", "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish",
        "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Shrink",
        "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh",
        "ThresholdedRelu", "Where", "Xor",
    }
)  # fmt: skip
_MS_ELEMENTWISE = frozenset({"BiasGelu", "FastGelu", "Gelu", "QuickGelu"})
_REDUCE = frozenset(
    {
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "ReduceSumSquare",
    }
)  # fmt: skip
# Reductions whose axes became an input (opset 18; ReduceSum at 13).
_AXES_INPUT_SINCE = 18
_SOFTMAX = frozenset({"Softmax", "LogSoftmax", "Hardmax"})
_NORMS = frozenset({"LayerNormalization", "RMSNormalization"})
_MS_NORMS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})


def _refused(path: str, reason: str) -> Refusal:
    """A gated branch that stays as it is, and why (``passes/_match.Refusal``, kind "gate")."""
    return Refusal(path, reason, kind="gate")


def read_refused_branches(model: ir.Model) -> list[Refusal]:
    """The refusals recorded in the model metadata ``layerzero.dynamic.refused`` (kind "gate" when unsaid)."""
    raw = model.metadata_props.get(REFUSED_META_KEY)
    return [] if not raw else [Refusal.from_json(d, kind="gate") for d in json.loads(raw)]


@dataclasses.dataclass
class _Match:
    add: ir.Node
    mul: ir.Node
    x: ir.Value  # the residual stream
    g: ir.Value  # the gate
    h_index: int  # which input of the Mul is f(x)
    kind: str  # "scalar" | "token"
    branch: list[ir.Node]  # f's nodes, graph order
    path: str


class SkipGatedBranches(ir.passes.InPlacePass):
    """Run a gated branch ``y = x + g * f(x)`` only where its gate is on.

    ``g`` is computed in the graph (a constant gate is the static passes' business); the Add and the
    Mul are matched in both operand orders. ``f`` is the set of nodes that feed the Mul's other input
    and nothing else (side inputs computed outside ``f`` are fine). A gate is on where
    ``|g| > threshold`` (``CompileOptions.zeroing_threshold``, absolute: not relative to other gates).
    At threshold 0 only gates exactly 0 are skipped, and the output is exactly the original's, since
    ``g * f(x)`` is 0 there (for finite ``f``).

    Cases:
    1. Scalar gate (shape ``[]`` or all ones, e.g. ``[1]``): ``If(|g| > t, then: x + g*f(x), else: x)``
       with ``f``'s nodes moved into the then-branch, so they do not run when the gate is off. Mask
       output ``layerzero::mask::<path>``, ``[]`` bool.
    2. Per-token gate (``x.shape[:-1] + [1]``, e.g. ``[T, 1]`` or ``[B, S, 1]``, Mixture-of-Depths):
       the tokens with ``|g| > t`` are gathered (``NonZero`` + ``GatherND``), ``f`` runs on them only
       (rank kept: ``[1, N, H]``), and ``x + g*f(x)`` of those tokens is scattered into ``x``
       (``ScatterND``); with no token on, an ``If`` skips ``f`` altogether. Mask output
       ``[...tokens]`` bool (``x.shape[:-1]``).
    3. A per-token gate whose ``f`` is not token-wise is left alone, and the reason is recorded in
       the model metadata ``layerzero.dynamic.refused`` (and ``self.refused``). Token-wise: elementwise
       ops whose other operands broadcast along the last axis only, MatMul / Gemm of the token
       stream with a weight, reductions / softmax / layer norms over the last axis. A MatMul of two
       token-dependent values (attention) mixes tokens and is refused; so is reading a token-shaped
       value computed outside ``f``.
    4. ``f(x)`` also read outside the branch: refused (the branch cannot be skipped).
    Each rewrite records a ``DynamicPath`` (kind "gate", one subpath, the parameters ``f`` reads);
    ``path`` is the common scope of ``f``'s nodes, else the Mul's name. Only the main graph is
    searched (a mask must be a graph output); the rewritten branch lives in a subgraph, so a second
    run changes nothing.
    """

    def __init__(self, threshold: float = 0.0) -> None:
        """``threshold``: a gate is on where ``|g| > threshold`` (``CompileOptions.zeroing_threshold``)."""
        super().__init__()
        threshold = float(threshold)
        if not threshold >= 0:
            raise ValueError(f"zeroing threshold must be >= 0, got {threshold}")
        self.threshold = threshold
        self.skipped: list[DynamicPath] = []
        self.refused: list[Refusal] = []
        self.opset = 18

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameFactory(graph)
        opset = self.opset = dict(model.opset_imports).get("", 1)
        taken = {p.path for p in read_dynamic_paths(model)}
        modified = False
        for node in list(graph):
            if node.graph is not graph or node.op_type != "Add" or node.domain not in _ONNX:
                continue
            match = self._match(graph, node, taken)
            if match is None:
                continue
            if isinstance(match, Refusal):
                logger.info("gated branch %s left as it is: %s", match.path, match.reason)
                self.refused.append(match)
                continue
            if match.kind == "token" and opset < 11:
                self.refused.append(_refused(match.path, f"a per-token gate needs opset >= 11, model has {opset}"))
                continue
            params = layer_params(match.branch)
            mask = self._rewrite(model, names, match, opset)
            taken.add(match.path)
            entry = DynamicPath(
                path=match.path,
                kind="gate",
                subpaths=(match.path,),
                params=(params,),
                mask_output=mask.name,
                detail={
                    "gate": match.g.name,
                    "gate_kind": match.kind,
                    "threshold": self.threshold,
                    "nodes": len(match.branch),
                },
            )
            record_dynamic_path(model, entry)
            self.skipped.append(entry)
            modified = True
            logger.info(
                "gated branch %s (%s gate, %d nodes) runs only where its gate is on",
                match.path,
                match.kind,
                len(match.branch),
            )
        modified |= _record_refused(model, self.refused)
        return ir.passes.PassResult(model, modified=modified)

    # ------------------------------------------------------------------------------------------ match

    def _match(self, graph: ir.Graph, add: ir.Node, taken: set[str]) -> _Match | Refusal | None:
        for i in (0, 1):  # x + m, m + x
            x, m = add.inputs[i], add.inputs[1 - i]
            if x is None or m is None or x is m:
                continue
            mul = m.producer()
            if mul is None or mul.graph is not graph or mul.op_type != "Mul" or mul.domain not in _ONNX:
                continue
            if m.is_graph_output() or len(m.uses()) != 1 or not same_shape(add.outputs[0], x):
                continue
            for j in (0, 1):  # g * h, h * g
                g, h = mul.inputs[j], mul.inputs[1 - j]
                if g is None or h is None or g is h or not same_shape(h, x):
                    continue
                kind = _gate_kind(g, x)
                if kind is None or const_array(g) is not None:
                    continue  # a constant gate is the static passes' job
                return self._branch(graph, add, mul, x, g, 1 - j, kind, taken)
        return None

    def _branch(
        self,
        graph: ir.Graph,
        add: ir.Node,
        mul: ir.Node,
        x: ir.Value,
        g: ir.Value,
        h_index: int,
        kind: str,
        taken: set[str],
    ) -> _Match | Refusal | None:
        h = mul.inputs[h_index]
        assert h is not None
        producer = h.producer()
        if producer is None or producer.graph is not graph:
            return None  # nothing to skip
        members = _exclusive_cone(h, mul, h_index)
        fallback = (mul.name or "").strip("/").replace("/", ".") or "gate"
        if not members:  # Case 4
            return _refused(fallback, f"f(x) ({h.name!r}) is also read outside the gated branch")
        branch = [n for n in graph if n in members]
        path = common_scope([scope_of(n) for n in branch]) or fallback
        path = _unique(path, taken)
        if kind == "token":
            problem = _not_tokenwise(branch, x, h, self.opset)
            if problem is not None:  # Case 3
                return _refused(path, f"per-token gate {g.name!r}: {problem}")
        return _Match(add, mul, x, g, h_index, kind, branch, path)

    # ---------------------------------------------------------------------------------------- rewrite

    def _rewrite(self, model: ir.Model, names: NameFactory, match: _Match, opset: int) -> ir.Value:
        graph = model.graph
        add, mul, x, g = match.add, match.mul, match.x, match.g
        build = _builder(graph, names, opset, add)  # the main graph's new nodes, placed before the Add
        then = build.body()  # the then-branch's new nodes
        y = add.outputs[0]
        y_type, y_shape = y.type, y.shape
        assert g.dtype is not None
        threshold = threshold_input(model, self.threshold)
        if g.dtype != threshold.dtype:
            threshold = build.op1("Cast", [threshold], to=g.dtype.value)
        on = build.op1("Greater", [build.op1("Abs", [g]), threshold])
        keep_node = build.body().node("Identity", [x])
        keep = keep_node.outputs[0]
        keep.type, keep.shape = x.type, x.shape
        then_branch = ir.Graph([], [], nodes=[], name=names(f"{match.path}.gate_on"))
        else_branch = ir.Graph([], [keep], nodes=[keep_node], name=names(f"{match.path}.gate_off"))

        if match.kind == "scalar":  # Case 1
            if len(g.shape or ()):
                mask = build.op1("Reshape", [on, build.initializer(f"{match.path}.scalar", np.array([], np.int64))])
            else:
                mask = on
            cond = mask
            moved = [*match.branch, mul, add]
            out = y
        else:  # Case 2
            rank = len(x.shape or ())
            mask = build.squeeze(on, [-1])
            nonzero = build.op1("NonZero", [mask])
            index = build.op1("Transpose", [nonzero], perm=[1, 0])  # [N, rank-1]
            zero = build.initializer(f"{match.path}.zero", np.array(0, np.int64))
            cond = build.op1("Greater", [build.op1("Size", [nonzero]), zero])
            lead = list(range(rank - 2))  # keep f's rank: [N, H] -> [1, ..., N, H]
            tokens = then.op1("GatherND", [x, index])
            gates = then.op1("GatherND", [g, index])
            if lead:
                tokens = then.unsqueeze(tokens, lead)
                gates = then.unsqueeze(gates, lead)
            for node in [*match.branch, add]:
                for k, value in enumerate(node.inputs):
                    if value is x:
                        node.replace_input_with(k, tokens)
            mul.replace_input_with(1 - match.h_index, gates)
            for node in [*match.branch, mul, add]:
                for value in node.outputs:
                    value.shape = None  # now [1, ..., N, ...]; shape inference fills it in again
            moved = [*match.branch, mul, add]
        mask.name = names(MASK_PREFIX + match.path)
        mask.dtype, mask.shape = ir.DataType.BOOL, ir.Shape(list(g.shape or [])[:-1] if match.kind == "token" else [])
        if_node = build.node("If", [cond], {"then_branch": then_branch, "else_branch": else_branch})
        new = if_node.outputs[0]
        new.type, new.shape = y_type, y_shape
        graph.insert_before(add, build.take())
        _redirect(y, new, graph, names)
        graph.remove(moved)
        then_branch.extend(then.take())
        then_branch.extend(moved)
        if match.kind == "token":
            updates = y if not lead else then.squeeze(y, lead)
            out = then.op1("ScatterND", [x, index, updates])
            out.type, out.shape = y_type, y_shape
            then_branch.extend(then.take())
        then_branch.outputs.append(out)
        graph.outputs.append(mask)
        read_round_trip_sources(if_node)  # onnxruntime's "Missing Input" (issue 14 cause 6)
        return mask


def _builder(graph: ir.Graph, names: NameFactory, opset: int, anchor: ir.Node) -> Builder:
    """New nodes named after the Add they replace (same scope path and name-scope metadata)."""
    name = anchor.name or ""
    prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    scopes = anchor.metadata_props.get(NAME_SCOPES_KEY)
    metadata = {NAME_SCOPES_KEY: scopes} if scopes is not None else None
    return Builder(graph, names, opset, node_prefix=f"{prefix}LzGate", metadata=metadata)


# --------------------------------------------------------------------------------------------- helpers


def _gate_kind(g: ir.Value, x: ir.Value) -> str | None:
    gs, xs = g.shape, x.shape
    if gs is None or xs is None or g.dtype is None or not g.dtype.is_floating_point():
        return None
    if len(gs) <= len(xs) and all(isinstance(d, int) and d == 1 for d in gs):
        return "scalar"
    if len(gs) == len(xs) >= 2 and gs[-1] == 1 and all(same_dim(a, b) for a, b in zip(gs[:-1], xs[:-1])):
        return "token"
    return None


def _exclusive_cone(h: ir.Value, mul: ir.Node, h_index: int) -> set[ir.Node]:
    """The nodes whose outputs are read only by each other and by ``mul`` (as its ``h_index`` input)."""
    graph = mul.graph
    members: set[ir.Node] = set()

    def exclusive(node: ir.Node) -> bool:
        for out in node.outputs:
            if out.is_graph_output():
                return False
            for user, index in out.uses():
                if user in members or (user is mul and index == h_index and out is h):
                    continue
                return False
        return True

    root = h.producer()
    if root is None or not exclusive(root):
        return set()
    members.add(root)
    while True:
        frontier = {v.producer() for n in members for v in n.inputs if v is not None} - members
        added = [n for n in frontier if n is not None and n.graph is graph and exclusive(n)]
        if not added:
            return members
        members.update(added)


def _not_tokenwise(branch: list[ir.Node], x: ir.Value, h: ir.Value, opset: int) -> str | None:
    """Why ``branch`` does not compute each token from that token alone (None when it does)."""
    rank = len(x.shape or ())
    token: set[ir.Value] = {x}
    problems: list[str] = []
    for node in branch:
        reads = [k for k, v in enumerate(node.inputs) if v is not None and v in token]
        if not reads:
            continue  # a side computation (a constant, a table): reads no token
        token.update(node.outputs)
        where = f"{node.op_type} node {node.name!r}"
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            problems.append(f"{where} has subgraphs")
            continue
        problem = _tokenwise_problem(node, reads, rank, opset)
        if problem is not None:
            problems.append(f"{where} {problem}")
            continue
        weights = (1,) if node.op_type in ("MatMul", "Gemm") else ()  # checked as [K, N] weights above
        for k, value in enumerate(node.inputs):
            if value is not None and k not in reads and k not in weights and not _token_free(value, rank):
                problems.append(
                    f"{where} reads {value.name!r} ({describe_value(value)}), which has token axes and is "
                    "computed outside the branch"
                )
                break
    if h not in token:
        problems.append(f"f(x) ({h.name!r}) does not read the residual stream {x.name!r}")
    # The most telling reason first: mixing tokens (attention) explains the rest.
    problems.sort(key=lambda p: "mixes tokens" not in p)
    return problems[0] if problems else None


def _tokenwise_problem(node: ir.Node, reads: list[int], rank: int, opset: int) -> str | None:
    op, domain = node.op_type, node.domain
    last = rank - 1
    if (domain in _ONNX and op in _ELEMENTWISE) or (domain == _MS and op in _MS_ELEMENTWISE):
        return None
    if domain in _ONNX and op == "MatMul":
        if reads != [0]:
            return "multiplies two token-dependent values (attention-like: it mixes tokens)"
        weight = node.inputs[1]
        shape = weight.shape if weight is not None else None
        if shape is None or len(shape) < 2 or any(d != 1 for d in shape[:-2]):
            return "multiplies by a value that is not a [K, N] weight"
        return None
    if domain in _ONNX and op == "Gemm":
        if reads != [0] or _attr(node, "transA", 0):
            return "multiplies two token-dependent values or contracts over tokens (transA)"
        return None if rank == 2 else "is a Gemm on a tensor that is not 2-D"
    if domain in _ONNX and op in _REDUCE:
        axes = _reduce_axes(node)
        if reads != [0] or axes is None or {a % rank for a in axes} != {last} or not _attr(node, "keepdims", 1):
            return "reduces over an axis other than the last (or drops it)"
        return None
    if domain in _ONNX and op in _SOFTMAX:
        default = -1 if opset >= 13 else 1
        if _attr(node, "axis", default) % rank != last:
            return "normalises over an axis other than the last"
        return None
    if (domain in _ONNX and op in _NORMS) or (domain == _MS and op in _MS_NORMS):
        if reads != [0] or _attr(node, "axis", -1) % rank != last:
            return "normalises over axes other than the last"
        return None
    return "is not a token-wise op (elementwise, MatMul with a weight, or a reduction over the last axis)"


def _reduce_axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return list(node.attributes["axes"].as_ints())
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = const_array(node.inputs[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    return None  # no axes: every axis


def _attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


def _token_free(value: ir.Value, rank: int) -> bool:
    """Broadcasts against a ``rank``-D token value along the last axis only."""
    shape = value.shape
    if shape is None:
        array = const_array(value)
        if array is None:
            return False
        dims: list[object] = list(array.shape)
    else:
        dims = list(shape)
    return len(dims) <= rank and all(isinstance(d, int) and d == 1 for d in dims[:-1])


def _unique(path: str, taken: set[str]) -> str:
    if path not in taken:
        return path
    k = 1
    while f"{path}#{k}" in taken:
        k += 1
    return f"{path}#{k}"


def _redirect(old: ir.Value, new: ir.Value, graph: ir.Graph, names: NameFactory) -> None:
    """Every reader of ``old`` reads ``new``; a graph output keeps its name (``new`` takes it)."""
    if old.is_graph_output():
        rename_output(graph, old, new, names, "gated")
    old.replace_all_uses_with(new, replace_graph_outputs=False)


def _record_refused(model: ir.Model, refused: list[Refusal]) -> bool:
    if not refused:
        return False
    entries = {r.path: r for r in read_refused_branches(model)}
    entries.update({r.path: r for r in refused})
    text = json.dumps([r.to_json() for r in entries.values()])
    if model.metadata_props.get(REFUSED_META_KEY) == text:
        return False
    model.metadata_props[REFUSED_META_KEY] = text
    return True
