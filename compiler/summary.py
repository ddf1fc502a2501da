"""What a model holds: flags, zero-weight tensors, layers and scopes with parameter counts, ops."""

from __future__ import annotations

import collections
import dataclasses

import onnx_ir as ir

from layerzero.contract import MOE_DOMAIN, MOE_OP
from layerzero.passes import declared_flags, flag_regex, uniform_of_constant
from layerzero.passes._graph import common_scope, layer_of, scope_of
from layerzero.passes._layers import initializer_size
from layerzero.passes.structured_zeros import PARAMS_REMOVED_KEY

__all__ = [
    "EXPORTER_ARTEFACT_SCOPES",
    "PARAMS_CAPTION",
    "MoEFinding",
    "ModelSummary",
    "ScopeCounts",
    "find_moe",
    "model_scope",
    "natural_key",
    "scope_counts",
    "summarize",
]


@dataclasses.dataclass
class FlagInfo:
    name: str
    scope: str
    value: float
    form: str  # "declared (initializer)" | "declared (metadata)" | "consumed"


@dataclasses.dataclass
class ModelSummary:
    nodes: int
    params: int
    layers: list[str]
    scope_nodes: dict[str, int]  # scope (and every ancestor) -> nodes in its subtree
    scope_params: dict[str, int]  # scope -> parameters read only inside its subtree
    flags: list[FlagInfo]
    zero_tensors: list[tuple[str, list[int]]]
    op_histogram: dict[str, int]
    # Weight and bias elements the structured-zeros pass sliced away (pruned neurons, heads, zero blocks).
    structured_params_removed: int = 0

    @property
    def consumed_flags(self) -> list[str]:
        return [f.scope for f in self.flags if f.form == "consumed"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _prefixes(scope: str) -> list[str]:
    parts = scope.split(".") if scope else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


#: What the parameter column of `inspect` and `flag --list` counts (both give ``scope_counts``'s numbers).
PARAMS_CAPTION = (
    "parameters: elements of the weights read only inside the scope (a weight shared with another scope counts "
    "for the scope holding both; int64 shape constants not counted)"
)

#: Scope names an exporter writes for nodes that belong to no module: no scope (torch.onnx's dynamo exporter
#: names the nodes it finds no module stack for so).
EXPORTER_ARTEFACT_SCOPES = frozenset({"_empty_nn_module_stack_from_metadata_hook"})


def model_scope(node: ir.Node) -> str:
    """The node's module scope (``passes._graph.scope_of``), "" for an exporter artefact that names no module."""
    scope = scope_of(node)
    return "" if scope.split(".", 1)[0] in EXPORTER_ARTEFACT_SCOPES else scope


@dataclasses.dataclass
class ScopeCounts:
    """Nodes and parameters per scope: the one count `inspect`, `flag --list` and compile's ``removed`` give.

    ``nodes[s]``: the nodes (of every graph) whose scope is ``s`` or below it. ``params[s]``: the parameters
    read only inside ``s`` (an initializer whose readers' common scope is ``s`` or below it; one shared with
    another scope counts for the scope enclosing both), int64 tensors (shapes, axes, indices) not counted.
    """

    nodes: dict[str, int]
    params: dict[str, int]
    total_nodes: int
    total_params: int


def scope_counts(model: ir.Model) -> ScopeCounts:
    """Count nodes and parameters per scope (see ``ScopeCounts``); reads no weight."""
    nodes, (params, total_params), _node_scope, ops = _count(model)
    return ScopeCounts(dict(nodes), dict(params), sum(ops.values()), total_params)


def _count(model: ir.Model):
    scope_nodes: collections.Counter[str] = collections.Counter()
    ops: collections.Counter[str] = collections.Counter()
    node_scope: dict[ir.Node, str] = {}
    for graph in model.graphs():
        for node in graph:
            ops[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"] += 1
            scope = model_scope(node)
            node_scope[node] = scope
            for prefix in _prefixes(scope):
                scope_nodes[prefix] += 1
    scope_params: collections.Counter[str] = collections.Counter()
    params = 0
    for graph in model.graphs():
        for init in graph.initializers.values():
            counted = initializer_size(init) if init.dtype != ir.DataType.INT64 else 0
            params += counted
            users = [node_scope.get(user, model_scope(user)) for user, _ in init.uses()]
            if users:
                for prefix in _prefixes(common_scope(users)):
                    scope_params[prefix] += counted
    return scope_nodes, (scope_params, params), node_scope, ops


def summarize(model: ir.Model, flag_pattern: str = "*.flag") -> ModelSummary:
    """Count nodes and parameters per scope; find flags and all-zero tensors (reads no weight it need not).

    Parameters are the elements of initializers that are not int64: int64 tensors are shapes, axes, indices
    and positions (the compile folds ``Shape`` computations into a few of them), never weights. The counts
    per scope are ``scope_counts``'s (``layerzero flag --list`` shows the same).
    """
    scope_nodes, (scope_params, params), _node_scope, ops = _count(model)
    nodes = sum(ops.values())
    zero_tensors: list[tuple[str, list[int]]] = []
    flags: list[FlagInfo] = []
    regex_flags = {f.name: f for f in declared_flags(model, flag_pattern)}
    for flag in regex_flags.values():
        form = f"declared ({flag.declared_in})"
        flags.append(FlagInfo(flag.name, flag.scope, flag.value, form))
    regex = flag_regex(flag_pattern)
    for graph in model.graphs():
        for name, init in graph.initializers.items():
            size = initializer_size(init)
            match = regex.match(name)
            if match and size == 1 and any(True for _ in init.uses()):
                value = uniform_of_constant(init)
                flags.append(
                    FlagInfo(name, match["scope"], float(value) if value is not None else float("nan"), "consumed")
                )
            elif size > 1 and (value := uniform_of_constant(init)) is not None and not bool(value):
                zero_tensors.append((name, list(init.shape.dims) if init.shape is not None else []))
    layers = sorted({layer for s in scope_nodes if (layer := layer_of(s))}, key=natural_key)
    return ModelSummary(
        nodes=nodes,
        params=params,
        layers=layers,
        scope_nodes=dict(scope_nodes),
        scope_params=dict(scope_params),
        flags=flags,
        zero_tensors=zero_tensors,
        op_histogram=dict(ops.most_common()),
        structured_params_removed=int(model.metadata_props.get(PARAMS_REMOVED_KEY, "0") or 0),
    )


def natural_key(scope: str) -> list:
    return [int(p) if p.isdigit() else p for p in scope.split(".")]


@dataclasses.dataclass
class MoEFinding:
    """A mixture-of-experts router and what the compiler will make of it."""

    scope: str
    rewritten: bool
    detail: str  # the block's form and shape, or why it is not rewritten
    node: str = ""  # not rewritten: the node where the matcher stopped

    def line(self) -> str:
        where = self.scope or "(no scope)"
        if self.rewritten:
            return f"MoE block at {where}: {self.detail}"
        at = f" (at node {self.node})" if self.node else ""
        return f"MoE candidate at {where}: not rewritten{at}: {self.detail}"


def find_moe(model: ir.Model) -> list[MoEFinding]:
    """Every router (TopK of Softmax/Sigmoid scores) of the model: a block the compiler rewrites into its
    skipping form, or a candidate with the reason it is left alone; in a compiled model, each block compile
    rewrote (its ``dynamic`` record, or a lowered ``MoE`` node). Infers shapes on ``model`` (in place)."""
    from layerzero.passes._dynamic import read_dynamic_paths
    from layerzero.passes._moe import find_moe_blocks
    from layerzero.passes.shape_inference import InferShapes

    InferShapes()(model)
    # A compiled model (a bundle's model.onnx): the blocks compile rewrote are recorded in its metadata; their
    # skipping form (per-expert If, our MoE op, com.microsoft::MoE) is no dense block the matcher knows.
    rewritten = [
        MoEFinding(d.path, True, "rewritten by compile into its skipping form: " + _rewritten_detail(d))
        for d in read_dynamic_paths(model)
        if d.kind == "moe"
    ]
    covered = [f.scope for f in rewritten]
    # A lowered MoE op with no metadata entry (a graph lowered by hand or the entry lost) is rewritten too.
    for node in model.graph:
        if node.op_type == MOE_OP and node.domain in (MOE_DOMAIN, "com.microsoft"):
            scope = model_scope(node)
            if not any(_related(scope, c) for c in covered):
                rewritten.append(MoEFinding(scope, True, f"rewritten: a {node.domain}::MoE node ({node.name})"))
                covered.append(scope)
    matches, rejections = find_moe_blocks(model.graph)
    found = rewritten + [
        MoEFinding(
            m.path,
            True,
            f"{m.form}, {m.experts} experts, top-{m.router.top_k}, {m.router.scoring}"
            f"{', renormalised' if m.normalize else ''}, {m.activation}, "
            f"{m.params_per_expert[0]:,} parameters per expert",
        )
        for m in matches
        if not any(_related(m.path, c) for c in covered)
    ]
    # The router of a rewritten block is still there (it feeds the skipping form): no candidate of its own.
    found += [
        MoEFinding(r.path, False, r.reason, r.node)
        for r in rejections
        if not any(_related(r.path, c) for c in covered)
    ]
    return sorted(found, key=lambda f: natural_key(f.scope))


def _related(a: str, b: str) -> bool:
    """``a`` and ``b`` are one scope, or one encloses the other (a block's router may sit in its layer)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _rewritten_detail(d) -> str:
    x = d.detail
    parts = [
        f"{x['form']}" if x.get("form") else "",
        f"{len(d.subpaths)} experts",
        f"top-{x['top_k']}" if x.get("top_k") else "",
        str(x.get("scoring") or ""),
        str(x.get("activation") or ""),
        f"{d.params[0]:,} parameters per expert" if d.params else "",
        f"lowered as {x['lowering']}" if x.get("lowering") else "",
    ]
    return ", ".join(p for p in parts if p)
