"""Solidify: remove for good the dynamic paths a profile found always skipped (``CompileOptions.solidify``).

Two passes of ``DYNAMIC_PASSES``: ``DropExperts`` on the MoE skipping form (after ``SkipExperts``, before
the lowering), ``RemoveSkippedBranches`` after the gated-branch pass. Each is given the subpaths to remove
(``CompileOptions.solidify``) (e.g. ``layers.0.moe.experts.3``, ``layers.2.mlp``, a group name) and records what it
removed in the model metadata ``layerzero.solidified`` (a JSON list of ``{subpath, path, kind, params}``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from layerzero.contract import SOLIDIFIED_META_KEY
from layerzero.errors import InvalidInputError
from layerzero.passes._builder import Builder
from layerzero.passes._dynamic import DYNAMIC_META_KEY, DynamicPath, read_dynamic_paths, record_dynamic_path
from layerzero.passes._dynamic_paths import driven_ifs, graph_output, moe_node
from layerzero.passes._graph import NameFactory, const_array, make_constant
from layerzero.passes._moe_node import MoENode

__all__ = ["SOLIDIFIED_META_KEY", "DropExperts", "RemoveSkippedBranches", "read_solidified"]

logger = logging.getLogger(__name__)



def read_solidified(model: ir.Model) -> list[dict]:
    raw = model.metadata_props.get(SOLIDIFIED_META_KEY)
    return [] if not raw else list(json.loads(raw))


def _record(model: ir.Model, records: list[dict]) -> None:
    done = {r["subpath"]: r for r in read_solidified(model)}
    done.update({r["subpath"]: r for r in records})
    model.metadata_props[SOLIDIFIED_META_KEY] = json.dumps(list(done.values()))


def _requested(solidify: Iterable[str]) -> frozenset[str]:
    if isinstance(solidify, str):
        raise TypeError("solidify is a collection of subpaths, not one string")
    return frozenset(str(s) for s in solidify)


class DropExperts(ir.passes.InPlacePass):
    """Remove solidified experts from their MoE blocks: from the router and from the weights.

    For each ``ai.layerzero::MoE`` node (path ``P``) with subpaths ``P.experts.<e>`` in ``solidify``:

    1. Weights: ``w_gate``, ``w_up``, ``w_down`` (and the v2 expert biases / score bias when present) keep the
       other experts only (the old initializers die in dead-code removal).
    2. Router: the logits lose the dropped experts' columns. A ``Gemm`` / ``MatMul`` (optionally ``+ bias``)
       router with constant weights, read by nothing else, loses those rows / columns of its weight and
       bias; any other router gets ``Gather(logits, kept, axis=-1)``.
    3. Top-k semantics are kept: each token picks its ``top_k`` experts among the kept ones, ranked as before.
       With softmax scoring the probabilities are now a softmax over the kept experts: with ``normalize``
       (the top-k weights divided by their sum) a token that did not pick a dropped expert gets exactly the
       weights it had; without it each weight grows by ``1 / (1 - p_dropped)``, which verification reports.
       Sigmoid scoring is per expert: unchanged.
    4. The path's ``DynamicPath`` keeps the kept subpaths (the mask's columns, in order) and their parameter
       counts; ``detail["solidified"]`` lists the dropped ones.
    Dropping so many experts that fewer than ``top_k`` remain raises ``InvalidInputError``.
    """

    def __init__(self, solidify: Iterable[str] = frozenset()) -> None:
        """``solidify``: the subpaths to remove (``CompileOptions.solidify``)."""
        super().__init__()
        self.requested = _requested(solidify)
        self.dropped: list[dict] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.dropped = []
        if not self.requested:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        names = NameFactory(graph)
        for entry in read_dynamic_paths(model):
            if entry.kind != "moe":
                continue
            drop = [j for j, s in enumerate(entry.subpaths) if s in self.requested]
            node = moe_node(graph, entry.path) if drop else None
            if node is None:
                continue
            self._drop(model, names, node, entry, drop)
        if self.dropped:
            _record(model, self.dropped)
        return ir.passes.PassResult(model, modified=bool(self.dropped))

    def _drop(self, model: ir.Model, names: NameFactory, node: ir.Node, entry: DynamicPath, drop: list[int]) -> None:
        # MoE(x, logits [T, E], w [E, ...])   ->   MoE(x, logits[:, kept], w[kept])
        graph = model.graph
        experts = len(entry.subpaths)
        kept = [j for j in range(experts) if j not in drop]
        view = MoENode.of(node)
        top_k = view.top_k
        if len(kept) < top_k:
            raise InvalidInputError(
                f"solidify: removing {len(drop)} of the {experts} experts of {entry.path} would leave fewer than "
                f"its top_k={top_k}; keep at least {top_k}"
            )
        if view.n_group != 1:
            raise InvalidInputError(
                f"solidify: {entry.path} limits top-k to the best of {view.n_group} groups of experts; dropping "
                "experts would change the groups (solidify none of its experts)"
            )
        # Case 1; 5-8: the v2 per-expert inputs (expert biases, score bias), when present.
        for i, weight in view.expert_inputs.items():
            array = const_array(weight)
            if array is None:
                raise InvalidInputError(
                    f"solidify: expert weight {weight and weight.name!r} of {entry.path} is not a constant"
                )
            _swap_constant(graph, names, node, i, np.ascontiguousarray(array[kept]))
        router_params = _drop_logit_columns(graph, names, node, entry.path, kept, experts)  # Case 2
        per_router_row = router_params // len(drop) if drop else 0
        for j in drop:
            self.dropped.append(
                {
                    "subpath": entry.subpaths[j],
                    "path": entry.path,
                    "kind": "moe",
                    "params": int(entry.params[j]) + per_router_row,
                }
            )
        detail = dict(entry.detail)
        detail["experts"] = len(kept)
        detail["solidified"] = [*detail.get("solidified", []), *(entry.subpaths[j] for j in drop)]
        record_dynamic_path(
            model,
            dataclasses.replace(
                entry,
                subpaths=tuple(entry.subpaths[j] for j in kept),
                params=tuple(entry.params[j] for j in kept),
                detail=detail,
            ),
        )
        logger.info("solidify: %s loses experts %s", entry.path, ", ".join(entry.subpaths[j] for j in drop))


def _drop_logit_columns(
    graph: ir.Graph, names: NameFactory, node: ir.Node, path: str, kept: list[int], experts: int
) -> int:
    """Give ``node`` (and the router-confidence op) the kept logit columns; the router parameters removed."""
    logits = node.inputs[1]
    assert logits is not None
    # Only the block reads the logits (its routing and router-confidence ops): the router itself can shrink.
    own = all(user is node or (user.name or "").startswith(f"/{path}/") for user, _ in logits.uses())
    removed = _slice_router(graph, names, logits, kept, experts) if own else None
    if removed is not None:
        if logits.shape is not None:
            logits.shape = ir.Shape([*list(logits.shape)[:-1], len(kept)])
        return removed
    build = Builder(graph, names, 0, node_prefix=f"/{path}/LzSolidify", value_prefix=f"{path}.")
    index = build.initializer(f"{path}.solidify.kept", np.array(kept, np.int64))
    gather = build.node("Gather", [logits, index], {"axis": -1})
    out = build.name(gather.outputs[0], f"{path}.kept_logits")
    out.dtype = logits.dtype
    for user, i in list(logits.uses()):
        if user is not gather:
            user.replace_input_with(i, out)
    graph.insert_before(node, gather)
    return 0


def _slice_router(graph: ir.Graph, names: NameFactory, logits: ir.Value, kept: list[int], experts: int) -> int | None:
    """Slice a constant-weight router in place; the parameters removed, or None when it is not one."""
    if logits.is_graph_output():
        return None
    producer = logits.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    bias_node, bias_index = None, None
    if producer.op_type == "Add":  # MatMul(x, W) + b
        for k in (0, 1):
            inner = producer.inputs[k]
            bias = producer.inputs[1 - k]
            inner_producer = inner.producer() if inner is not None else None
            if (
                inner_producer is not None
                and inner_producer.op_type == "MatMul"
                and len(inner.uses()) == 1
                and not inner.is_graph_output()
                and const_array(bias) is not None
            ):
                bias_node, bias_index, producer = producer, 1 - k, inner_producer
                break
        else:
            return None
    changes: list[tuple[ir.Node, int, np.ndarray]] = []
    if producer.op_type == "Gemm":
        weight = const_array(producer.inputs[1])
        trans_b = producer.attributes.get("transB")
        trans_b = int(trans_b.value) if trans_b is not None else 0
        if weight is None or weight.ndim != 2 or weight.shape[0 if trans_b else 1] != experts:
            return None
        changes.append((producer, 1, weight[kept] if trans_b else weight[:, kept]))
        bias = const_array(producer.inputs[2]) if len(producer.inputs) > 2 else None
        if bias is not None and bias.ndim >= 1 and bias.shape[-1] == experts:
            changes.append((producer, 2, bias[..., kept]))
    elif producer.op_type == "MatMul":
        weight = const_array(producer.inputs[1])
        if weight is None or weight.ndim != 2 or weight.shape[1] != experts:
            return None
        changes.append((producer, 1, weight[:, kept]))
    else:
        return None
    if bias_node is not None:
        bias = const_array(bias_node.inputs[bias_index])
        if bias.ndim >= 1 and bias.shape[-1] == experts:
            changes.append((bias_node, bias_index, bias[..., kept]))
        elif bias.size != 1:
            return None
    removed = 0
    for owner, i, array in changes:
        removed += int(const_array(owner.inputs[i]).size - array.size)
        _swap_constant(graph, names, owner, i, np.ascontiguousarray(array))
    return removed


def _swap_constant(graph: ir.Graph, names: NameFactory, node: ir.Node, index: int, array: np.ndarray) -> None:
    """``node`` reads ``array`` as input ``index``; the old initializer, when nothing else reads it, goes and
    leaves its name to the new one."""
    old = node.inputs[index]
    hint = (old.name if old is not None else None) or "solidified"
    new = make_constant(graph, names, hint, array)
    node.replace_input_with(index, new)
    if old is not None and old.is_initializer() and not old.is_graph_input() and not old.uses() and old.name:
        name = old.name
        graph.initializers.pop(name)
        graph.initializers.pop(new.name)
        new.name = name
        new.const_value.name = name
        graph.register_initializer(new)


class RemoveSkippedBranches(ir.passes.InPlacePass):
    """Solidified gated branches and groups take their else path for good.

    For each gate or group whose subpath is in ``solidify``:

    1. Every ``If`` whose condition is computed from the path's mask gets a constant false condition;
       constant folding then inlines the else branch (the residual for a gate, the bypassed layers for a
       group) and dead-code removal takes the branch, its gate / router decision and their weights.
    2. The mask output and the path's ``DynamicPath`` go; the removal is recorded (``layerzero.solidified``).
    """

    def __init__(self, solidify: Iterable[str] = frozenset()) -> None:
        """``solidify``: the subpaths to remove (``CompileOptions.solidify``)."""
        super().__init__()
        self.requested = _requested(solidify)
        self.removed: list[dict] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.removed = []
        if not self.requested:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        names = NameFactory(graph)
        gone: list[str] = []
        for entry in read_dynamic_paths(model):
            if entry.kind == "moe" or not any(s in self.requested for s in entry.subpaths):
                continue
            mask = graph_output(graph, entry.mask_output)
            if mask is None:
                continue
            ifs = driven_ifs(graph, mask)
            if not ifs:
                continue
            false = make_constant(graph, names, f"{entry.path}.solidified", np.array(False))
            for node in ifs:  # Case 1
                node.replace_input_with(0, false)
            graph.outputs.remove(mask)  # Case 2
            gone.append(entry.path)
            self.removed.append(
                {
                    "subpath": entry.subpaths[0],
                    "path": entry.path,
                    "kind": entry.kind,
                    "params": int(sum(entry.params)),
                    "scopes": list(entry.detail.get("scopes") or [entry.path]),
                }
            )
            logger.info("solidify: %s %s takes its else path", entry.kind, entry.path)
        if gone:
            remaining = [e.to_dict() for e in read_dynamic_paths(model) if e.path not in gone]
            model.metadata_props[DYNAMIC_META_KEY] = json.dumps(remaining)
            _record(model, self.removed)
        return ir.passes.PassResult(model, modified=bool(gone))
