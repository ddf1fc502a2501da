"""Group masks: a router turns named groups of layers on and off per request."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._dynamic import MASK_PREFIX, DynamicPath, read_dynamic_paths, record_dynamic_path
from layerzero.passes._dynamic_paths import graph_output
from layerzero.passes._graph import (
    NameFactory,
    insert_after_producer,
    rename_output,
    scope_of,
)
from layerzero.passes._layers import Layer, bypassable_layer, in_scope, layer_params, scope_members

__all__ = ["ApplyGroupMasks", "Group", "GroupRouter", "GroupSpec"]

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class Group:
    """Layers (scopes) that run only when element ``index`` of the router output is above threshold."""

    name: str
    scopes: tuple[str, ...]
    index: int


@dataclasses.dataclass(frozen=True)
class GroupRouter:
    """Where the router values come from.

    ``model`` None: ``output`` names a value of the model (typically a graph output). Otherwise
    ``model`` is a separate router, fed the model's inputs of the same names, and ``output`` names
    one of its outputs; it is merged into the model.
    """

    output: str
    model: ir.Model | None = None


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    groups: tuple[Group, ...]
    router: GroupRouter
    threshold: float = DEFAULT_THRESHOLD
    source: str = "group spec"  # names the spec in error messages (its file)


class ApplyGroupMasks(ir.passes.InPlacePass):
    """Run each group's layers only when the router says so.

    Cases:
    1. Router values are a value of the model (``router.output``), or the output of a separate router
       model, merged into the graph: its names get a ``router/`` prefix, its inputs are the model's
       inputs of the same names (same dtype), its initializers move into the model.
    2. A group is on when ``router[..., index] > threshold``; with a batch (leading axes), when any
       sample's value is (``ReduceMax``): the group then runs for the whole batch. The decision is the
       graph output ``layerzero::mask::<group name>`` (``[]`` bool); a ``DynamicPath`` (kind "group",
       one subpath, the parameters its scopes read) is recorded.
    3. Each scope of a group must be a layer that can be bypassed exactly as for declared zero flags
       (one value leaves it; one entering value has its dtype and shape). Its nodes move into
       ``If(mask, then: layer, else: Identity(input))``.
    4. ``select=True`` builds the verification reference instead: the layers compute as before and
       ``Where(mask, output, input)`` picks; no mask output, nothing recorded.
    5. Spec errors raise ``InvalidInputError`` naming the spec and the problem: a scope no node has,
       a scope that cannot be bypassed, a scope in two groups, an index outside the router output, a
       router output or router input the model lacks, a router that reads a grouped layer.
    Groups already recorded in the model (a second run) are left as they are. Only the main graph
    is searched for scopes.
    """

    def __init__(self, spec: GroupSpec, *, select: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.select = select
        self.applied: list[DynamicPath] = []
        self.opset = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        spec = self.spec
        graph = model.graph
        done = {p.path for p in read_dynamic_paths(model) if p.kind == "group"}
        groups = [g for g in spec.groups if self.select or g.name not in done]
        if not groups:
            return ir.passes.PassResult(model, modified=False)
        self._check_disjoint(groups)
        names = NameFactory(graph)
        self.opset = model_opset(model)
        scopes = {node: scope_of(node) for node in graph}
        layers = {g.name: [self._layer(graph, scopes, g, s) for s in g.scopes] for g in groups}  # Case 3, 5
        router_model = None
        if spec.router.model is None:
            router = self._model_value(graph)
            self._check_router_independent(router, layers)
        else:
            router_model = ir.from_proto(ir.to_proto(spec.router.model))  # the spec's copy stays intact
            router = self._router_output(router_model)
            self._check_router_inputs(router_model, graph)
        self._check_indices(router, groups)
        if router_model is not None:  # Case 1: merge, only once everything checked out
            router = _merge_router(model, router_model, router, names)
        replaced: dict[ir.Value, ir.Value] = {}
        for group in groups:
            mask = self._decision(graph, names, router, group)
            for layer in layers[group.name]:
                # A layer whose input was an earlier layer's output reads what replaced that output.
                source = replaced.get(layer.input, layer.input)
                if self.select:
                    replaced[layer.output] = _select(graph, names, self.opset, layer, source, mask)
                else:
                    replaced[layer.output] = _run_if(graph, names, self.opset, layer, source, mask, group)
            if self.select:
                continue
            graph.outputs.append(mask)
            members = [n for layer in layers[group.name] for n in layer.members]
            entry = DynamicPath(
                path=group.name,
                kind="group",
                subpaths=(group.name,),
                params=(layer_params(members),),
                mask_output=mask.name,
                detail={
                    "scopes": list(group.scopes),
                    "index": group.index,
                    "threshold": spec.threshold,
                    "router": spec.router.output,
                },
            )
            record_dynamic_path(model, entry)
            self.applied.append(entry)
            logger.info(
                "group %s (%s) runs when router[%d] > %g",
                group.name,
                ", ".join(group.scopes),
                group.index,
                spec.threshold,
            )
        graph.sort()
        return ir.passes.PassResult(model, modified=True)

    # ------------------------------------------------------------------------------------------ checks

    def _where(self, group: Group | None = None) -> str:
        return f"{self.spec.source}: group {group.name!r}" if group is not None else self.spec.source

    def _check_disjoint(self, groups: list[Group]) -> None:
        seen: list[tuple[str, Group]] = []
        for group in groups:
            for scope in group.scopes:
                for other, owner in seen:
                    if in_scope(other, scope) or in_scope(scope, other):
                        raise InvalidInputError(
                            f"{self._where(group)}: scope {scope!r} overlaps scope {other!r} of group "
                            f"{owner.name!r}; a layer belongs to one group"
                        )
                seen.append((scope, group))

    def _layer(self, graph: ir.Graph, scopes: dict[ir.Node, str], group: Group, scope: str) -> Layer:
        members = scope_members(graph, scope, scopes)
        if not members:
            raise InvalidInputError(
                f"{self._where(group)}: no node has scope {scope!r} (unknown, or removed by a zero flag); "
                "`layerzero inspect` lists the model's scopes"
            )
        return bypassable_layer(scope, members, f"{self._where(group)}: scope {scope!r}", error=InvalidInputError)

    def _model_value(self, graph: ir.Graph) -> ir.Value:
        name = self.spec.router.output
        value = graph_output(graph, name)
        if value is not None:
            return value
        for value in graph.inputs:
            if value.name == name:
                return value
        for node in graph:
            for value in node.outputs:
                if value.name == name:
                    return value
        outputs = ", ".join(repr(v.name) for v in graph.outputs) or "none"
        raise InvalidInputError(
            f"{self._where()}: router output {name!r} is not a value of the model (its outputs: {outputs})"
        )

    def _router_output(self, router: ir.Model) -> ir.Value:
        name = self.spec.router.output
        value = graph_output(router.graph, name)
        if value is not None:
            return value
        outputs = ", ".join(repr(v.name) for v in router.graph.outputs) or "none"
        raise InvalidInputError(f"{self._where()}: the router model has no output {name!r} (its outputs: {outputs})")

    def _check_router_inputs(self, router: ir.Model, graph: ir.Graph) -> None:
        inputs = {v.name: v for v in graph.inputs}
        for value in router.graph.inputs:
            if value.is_initializer():
                continue
            ours = inputs.get(value.name)
            if ours is None:
                raise InvalidInputError(
                    f"{self._where()}: router input {value.name!r} is not an input of the model "
                    f"(its inputs: {', '.join(map(repr, inputs)) or 'none'}); the router is fed the model's inputs"
                )
            if value.dtype is not None and ours.dtype is not None and value.dtype != ours.dtype:
                raise InvalidInputError(
                    f"{self._where()}: router input {value.name!r} is {value.dtype.name.lower()}, "
                    f"the model's is {ours.dtype.name.lower()}"
                )

    def _check_router_independent(self, router: ir.Value, layers: dict[str, list[Layer]]) -> None:
        owner = {n: (name, layer.scope) for name, ls in layers.items() for layer in ls for n in layer.members}
        seen: set[ir.Node] = set()
        stack = [router.producer()]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in owner:
                group, scope = owner[node]
                raise InvalidInputError(
                    f"{self._where()}: router output {router.name!r} is computed from scope {scope!r} of group "
                    f"{group!r}; a router must not depend on the layers it switches"
                )
            stack.extend(v.producer() for v in node.inputs if v is not None)

    def _check_indices(self, router: ir.Value, groups: list[Group]) -> None:
        shape = router.shape
        if shape is not None and len(shape) == 0:
            raise InvalidInputError(
                f"{self._where()}: router output {router.name!r} is a scalar; groups index its last axis"
            )
        size = shape[-1] if shape is not None else None
        for group in groups:
            if group.index < 0 or (isinstance(size, int) and group.index >= size):
                raise InvalidInputError(
                    f"{self._where(group)}: index {group.index} is out of range for router output "
                    f"{router.name!r} of shape {list(shape) if shape is not None else '?'}"
                )
            if not isinstance(size, int):
                logger.warning(
                    "router output %s has no static last dim; group %s index %d is unchecked",
                    router.name,
                    group.name,
                    group.index,
                )

    # -------------------------------------------------------------------------------------- rewrites

    def _decision(self, graph: ir.Graph, names: NameFactory, router: ir.Value, group: Group) -> ir.Value:
        """``[]`` bool: ``max(router[..., index]) > threshold`` (Case 2), placed after the router."""
        dtype = router.dtype.numpy() if router.dtype is not None else np.float32
        build = Builder(graph, names, self.opset, node_prefix=f"/lz_groups/{group.name}/")
        index = build.initializer(f"{group.name}.router_index", np.array(group.index, dtype=np.int64))
        threshold = build.initializer(f"{group.name}.threshold", np.array(self.spec.threshold, dtype=dtype))
        value = build.op1("Gather", [router, index], axis=-1)
        if router.shape is None or len(router.shape) > 1:
            value = build.op1("ReduceMax", [value], keepdims=0)
        mask = build.op1("Greater", [value, threshold])
        mask.name = names(MASK_PREFIX + group.name) if not self.select else names(f"{group.name}__on")
        mask.dtype, mask.shape = ir.DataType.BOOL, ir.Shape([])
        insert_after_producer(graph, router, build.take())  # in order, after the router
        return mask


def _external_uses(value: ir.Value, inside: set[ir.Node]) -> list[tuple[ir.Node, int]]:
    return [(user, i) for user, i in value.uses() if user not in inside]


def _take_over(old: ir.Value, new: ir.Value, graph: ir.Graph, names: NameFactory, inside: set[ir.Node]) -> None:
    """Readers of ``old`` outside ``inside`` read ``new``; a graph output keeps its name (``new`` takes it)."""
    new.type, new.shape = old.type, old.shape
    if old.is_graph_output():
        rename_output(graph, old, new, names, "grouped")
    for user, i in _external_uses(old, inside):
        user.replace_input_with(i, new)


def _run_if(
    graph: ir.Graph, names: NameFactory, opset: int, layer: Layer, source: ir.Value, mask: ir.Value, group: Group
) -> ir.Value:
    # before: x -> [layer] -> out -> readers
    # after:  x -> If(mask, then: [layer] -> out, else: Identity(x)) -> readers
    build = Builder(graph, names, opset, node_prefix=f"/{layer.scope}/LzGroup")
    then_branch = ir.Graph([], [], nodes=[], name=names(f"{group.name}.{layer.scope}.on"))
    keep_node = build.body().node("Identity", [source])
    keep = keep_node.outputs[0]
    keep.type, keep.shape = source.type, source.shape
    else_branch = ir.Graph([], [keep], nodes=[keep_node], name=names(f"{group.name}.{layer.scope}.off"))
    if_node = build.node("If", [mask], {"then_branch": then_branch, "else_branch": else_branch})
    out = if_node.outputs[0]
    graph.insert_after(layer.members[-1], if_node)
    _take_over(layer.output, out, graph, names, set(layer.members))
    graph.remove(list(layer.members))
    then_branch.extend(layer.members)
    then_branch.outputs.append(layer.output)
    return out


def _select(
    graph: ir.Graph, names: NameFactory, opset: int, layer: Layer, source: ir.Value, mask: ir.Value
) -> ir.Value:
    # before: x -> [layer] -> out -> readers;  after: Where(mask, out, x) -> readers
    where = Builder(graph, names, opset, node_prefix=f"/{layer.scope}/LzGroup").node(
        "Where", [mask, layer.output, source]
    )
    out = where.outputs[0]
    graph.insert_after(layer.members[-1], where)
    _take_over(layer.output, out, graph, names, {*layer.members, where})
    return out


def _merge_router(model: ir.Model, router: ir.Model, output: ir.Value, names: NameFactory) -> ir.Value:
    """Move the router's nodes and initializers into ``model`` (names prefixed), fed the model's inputs."""
    graph, rgraph = model.graph, router.graph
    inputs = {v.name: v for v in graph.inputs}
    for domain, version in router.opset_imports.items():
        model.opset_imports.setdefault(domain, version)
    rgraph.outputs.clear()
    for sub in router.graphs():
        for node in sub:
            node.name = names(f"router/{node.name or node.op_type}")
            for value in node.outputs:
                value.name = names(f"router/{value.name or node.name}")
    for name, init in list(rgraph.initializers.items()):
        rgraph.initializers.pop(name)
        init.name = names(f"router/{name}")
        if init.is_graph_input():
            rgraph.inputs.remove(init)
        graph.register_initializer(init)
    for value in list(rgraph.inputs):
        value.replace_all_uses_with(inputs[value.name])
    nodes = list(rgraph)
    rgraph.remove(nodes)
    insert_after_producer(graph, None, nodes)  # at the start: the router reads only the model's inputs
    return output
