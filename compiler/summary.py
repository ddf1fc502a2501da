"""What a model holds: flags, zero-weight tensors, layers and scopes with parameter counts, ops."""

from __future__ import annotations

import collections
import dataclasses

import onnx_ir as ir

from layerzero.passes import declared_flags, flag_regex, uniform_of_constant
from layerzero.passes._graph import common_scope, layer_of, scope_of
from layerzero.passes._layers import initializer_size
from layerzero.passes.structured_zeros import PARAMS_REMOVED_KEY

__all__ = ["MoEFinding", "ModelSummary", "find_moe", "natural_key", "summarize"]


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


def summarize(model: ir.Model, flag_pattern: str = "*.flag") -> ModelSummary:
    """Count nodes and parameters per scope; find flags and all-zero tensors (reads no weight it need not).

    Parameters are the elements of initializers that are not int64: int64 tensors are shapes, axes, indices
    and positions (the compile folds ``Shape`` computations into a few of them), never weights.
    """
    scope_nodes: collections.Counter[str] = collections.Counter()
    ops: collections.Counter[str] = collections.Counter()
    node_scope: dict[ir.Node, str] = {}
    nodes = 0
    for graph in model.graphs():
        for node in graph:
            nodes += 1
            ops[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"] += 1
            scope = scope_of(node)
            node_scope[node] = scope
            for prefix in _prefixes(scope):
                scope_nodes[prefix] += 1
    scope_params: collections.Counter[str] = collections.Counter()
    params = 0
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
            counted = size if init.dtype != ir.DataType.INT64 else 0
            params += counted
            users = [node_scope.get(user, scope_of(user)) for user, _ in init.uses()]
            if users:
                common = common_scope(users)
                for prefix in _prefixes(common):
                    scope_params[prefix] += counted
            match = regex.match(name)
            if match and users and size == 1:
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
    skipping form, or a candidate with the reason it is left alone. Infers shapes on ``model`` (in place)."""
    from layerzero.passes._moe import find_moe_blocks
    from layerzero.passes.shape_inference import InferShapes

    InferShapes()(model)
    matches, rejections = find_moe_blocks(model.graph)
    found = [
        MoEFinding(
            m.path,
            True,
            f"{m.form}, {m.experts} experts, top-{m.router.top_k}, {m.router.scoring}"
            f"{', renormalised' if m.normalize else ''}, {m.activation}, "
            f"{m.params_per_expert[0]:,} parameters per expert",
        )
        for m in matches
    ]
    found += [MoEFinding(r.path, False, r.reason, r.node) for r in rejections]
    return sorted(found, key=lambda f: natural_key(f.scope))
