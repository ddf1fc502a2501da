"""Router variant ``biased-select``: chosen by biased, group-limited scores, weighed by the unbiased ones."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._moe.routers.common import (
    MASK_TYPES,
    NORMALIZE_EPS,
    filled,
    past_same_type_cast,
    reduces_rows,
    same_type_cast,
    through_identity,
)
from layerzero.passes._moe.walk import (
    STD,
    NoMatch,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    const_scalar,
    need,
    reshape_dims,
    sorted_axes,
    static_dim,
)

__all__ = ["biased_select", "gathered_weights", "group_mask"]


def biased_select(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool, dict]:
    """``TopK(scores + bias, masked to the best groups)`` choosing, ``GatherElements(scores)`` weighing
    (DeepSeek-V3, GLM4-MoE, dots1, Ernie-4.5-MoE; the module docstring's ``biased-select``)."""
    gathers = [
        u
        for u, i in topk.outputs[1].uses()
        if i == 1 and u.op_type == "GatherElements" and u.domain in STD and attr_of(u, "axis", 0) in (-1, 1)
    ]
    need(len(gathers) == 1, "router: the top-k indices do not gather the routing weights (GatherElements)")
    gather = gathers[0]
    scores_value = gather.inputs[0]
    extra: dict = {"nodes": [gather]}
    scores = past_same_type_cast(scores_value, extra["nodes"]).producer()
    need(
        scores is not None and scores.op_type in ("Softmax", "Sigmoid") and scores.domain in STD,
        f"router: GatherElements {gather.name} does not gather Softmax or Sigmoid scores",
        topk,
        gather,
    )
    if scores.op_type == "Softmax":
        need(attr_of(scores, "axis", -1) in (-1, 1), "router: Softmax is not over the experts axis")
    experts = static_dim(scores.inputs[0], 1)
    need(experts is not None, f"router: the number of experts (dim 1 of {scores.inputs[0].name}) is not static")
    select = topk.inputs[0]
    where = select.producer()
    if where is not None and where.op_type == "Where" and where.domain in STD:
        select, extra["n_group"], extra["topk_group"], group_nodes = group_mask(where, experts)
        extra["nodes"].extend([where, *group_nodes])
    if select is not scores_value:
        add = select.producer()
        need(
            add is not None and add.op_type == "Add" and add.domain in STD,
            f"router: TopK {topk.name} chooses by neither the gathered scores nor scores + a bias",
        )
        for operand, bias_value in commuted(add):
            bias = through_identity(bias_value)
            if operand is scores_value and bias is not None and bias.size == experts:
                break
        else:
            raise NoMatch(f"router: Add {add.name} is not the scores plus a constant bias of {experts} values")
        need(bias.dtype.kind == "f", f"router: the score bias {bias_value.name} is not a float tensor")
        extra["score_bias"] = bias.reshape(-1).astype(np.float32)
        extra["nodes"].append(add)
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    size = experts // extra.get("n_group", 1)
    need(
        k is None or k[0] <= extra.get("topk_group", 1) * size,
        f"router: top-{k and k[0]} of {extra.get('topk_group', 1)} groups of {size} experts chooses -inf scores",
    )
    values, normalized, scaling, weight_nodes = gathered_weights(gather.outputs[0], scores.op_type, k, experts)
    extra["nodes"].extend(weight_nodes)
    extra["routed_scaling_factor"] = scaling
    return scores, scores.inputs[0], values, normalized, extra


def group_mask(where: ir.Node, experts: int) -> tuple[ir.Value, int, int, list[ir.Node]]:
    """``Where`` keeping the scores of the ``topk_group`` best groups: ``(scores, n_group, topk_group, nodes)``."""
    what = f"router group limit (Where {where.name})"
    condition, a, b = where.inputs
    inf_a, inf_b = const_scalar(a), const_scalar(b)
    need(
        (inf_a is not None and inf_a == -np.inf) != (inf_b is not None and inf_b == -np.inf),
        f"{what}: neither branch is -inf",
    )
    select, inf_when = (b, True) if inf_a == -np.inf else (a, False)
    # Backwards from the condition: Cast / Not / Identity anywhere, then Reshape, Expand, Unsqueeze in order.
    nodes: list[ir.Node] = []
    negations, shaping, value = 0, [], condition
    while True:
        node = value.producer()
        need(node is not None and node.domain in STD, f"{what}: the condition is not computed from a group mask")
        if node.op_type == "ScatterElements":
            break
        need(
            node.op_type in ("Not", "Cast", "Identity", "Reshape", "Expand", "Unsqueeze") and len(nodes) < 12,
            f"{what}: {node.op_type} {node.name} in the group mask",
        )
        nodes.append(node)
        if node.op_type == "Not":
            negations += 1
        elif node.op_type == "Cast":
            to = attr_of(node, "to")
            need(to is not None and ir.DataType(to) in MASK_TYPES, f"{what}: Cast {node.name} to {to}")
        elif node.op_type in ("Reshape", "Expand", "Unsqueeze"):
            shaping.append(node)
        value = node.inputs[0]
    # -inf where the condition holds: the condition says "not kept" (an odd number of Not).
    need(negations % 2 == int(inf_when), f"{what}: the -inf goes to the kept groups")
    need(
        [n.op_type for n in shaping] == ["Reshape", "Expand", "Unsqueeze"],
        f"{what}: the group mask is not Reshape(Expand(Unsqueeze(groups, -1)))",
    )
    reshape, _, unsqueeze = shaping
    dims = reshape_dims(reshape)
    need(dims is not None and dims[-1] == experts, f"{what}: the group mask is not reshaped to [T, {experts}]")
    need(sorted_axes(axes_of(unsqueeze), 3) == [2], f"{what}: the groups are not unsqueezed on the last axis")
    scatter = node
    nodes.append(scatter)
    need(
        attr_of(scatter, "axis", 0) in (-1, 1) and attr_of(scatter, "reduction", "none") == "none",
        f"{what}: ScatterElements {scatter.name} is not along the groups axis",
    )
    need(filled(scatter.inputs[0], nodes) == 0, f"{what}: the group mask is not scattered into zeros")
    ones = filled(scatter.inputs[2], nodes)
    need(ones is not None and ones != 0, f"{what}: the scattered group mask values are not a nonzero constant")
    group_topk = scatter.inputs[1].producer()
    need(
        group_topk is not None and group_topk.op_type == "TopK" and scatter.inputs[1] is group_topk.outputs[1],
        f"{what}: the groups kept are not TopK indices",
    )
    topk_group = const_ints(group_topk.inputs[1])
    need(
        topk_group is not None
        and attr_of(group_topk, "largest", 1) == 1
        and attr_of(group_topk, "axis", -1) in (-1, 1),
        f"{what}: TopK {group_topk.name} does not keep the best groups (constant k, largest, last axis)",
    )
    group_sum = group_topk.inputs[0].producer()
    need(
        group_sum is not None
        and group_sum.op_type == "ReduceSum"
        and sorted_axes(axes_of(group_sum), 3) == [2]
        and attr_of(group_sum, "keepdims", 1) == 0,
        f"{what}: the group scores are not a ReduceSum over each group's last axis",
    )
    top2 = group_sum.inputs[0].producer()
    need(
        top2 is not None
        and top2.op_type == "TopK"
        and group_sum.inputs[0] is top2.outputs[0]
        and const_ints(top2.inputs[1]) == [2]
        and attr_of(top2, "largest", 1) == 1
        and attr_of(top2, "axis", -1) in (-1, 2),
        f"{what}: a group's score is not the sum of its top-2 scores",
    )
    grouping = top2.inputs[0].producer()
    need(grouping is not None and grouping.op_type == "Reshape", f"{what}: the scores are not reshaped into groups")
    dims = reshape_dims(grouping)
    need(
        dims is not None and len(dims) == 3 and dims[1] > 0 and dims[2] >= 2 and dims[1] * dims[2] == experts,
        f"{what}: the scores are not reshaped to [T, groups, {experts} / groups]",
    )
    need(grouping.inputs[0] is select, f"{what}: the groups are scored from other values than the masked ones")
    n_group = dims[1]
    need(1 <= topk_group[0] <= n_group, f"{what}: topk_group {topk_group[0]} is outside 1..{n_group}")
    nodes.extend([group_topk, group_sum, top2, grouping])
    return select, n_group, topk_group[0], nodes


def gathered_weights(
    gathered: ir.Value, scoring: str, k: list[int] | None, experts: int
) -> tuple[ir.Value, bool, float, list[ir.Node]]:
    """Forwards from the gathered scores: the optional normalisation, then the optional scaling.
    ``(weights, normalized, routed_scaling_factor, nodes)``.

    The denominator: ``ReduceSum(w, -1, keepdims=1)``, ``+ eps`` (eps ≤ 1e-20, the form's own; with softmax
    scores any eps ≤ 1e-9 · k / E, as the sum is at least k / E), or ``Clip`` / ``Max`` at ``min`` (with softmax
    scores only, for min ≤ k / E: Ernie-4.5-MoE's ``clamp(min=norm_min)`` never acts there)."""
    value, normalized, scaling, nodes = gathered, False, 1.0, []
    users = [u for u, _ in value.uses()]
    divs = [u for u in users if u.op_type == "Div" and u.domain in STD and u.inputs[0] is value]
    if len(divs) == 1 and len(users) == 2:
        div = divs[0]
        denominator = div.inputs[1].producer()
        if denominator is not None and denominator.op_type in ("Add", "Clip", "Max") and denominator.domain in STD:
            bound = _bound(denominator)
            floor = 0.0 if k is None else k[0] / experts  # the smallest sum of the k largest softmax scores
            if denominator.op_type == "Add":
                need(
                    (bound is not None and 0 <= bound <= NORMALIZE_EPS * (1 + 1e-6))
                    or (scoring == "Softmax" and bound is not None and 0 <= bound <= 1e-9 * floor),
                    f"routing weights: {denominator.name} adds {bound} to the sum (the form adds 1e-20)",
                )
            else:
                need(
                    scoring == "Softmax" and bound is not None and bound <= floor,
                    f"routing weights: {denominator.op_type} {denominator.name} bounds the sum below by {bound}, "
                    "which changes the weights",
                )
            nodes.append(denominator)
            total = denominator.inputs[0].producer() if denominator.op_type != "Add" else _other_sum(denominator)
        else:
            total = denominator
        need(
            reduces_rows(total, "ReduceSum", value),
            f"routing weights: Div {div.name} does not divide by the sum of the gathered weights",
        )
        nodes.extend([total, div])
        value, normalized = div.outputs[0], True
    users = [u for u, _ in value.uses()]
    if len(users) == 1 and same_type_cast(users[0]):  # TorchScript's .to(hidden dtype) of float32 weights
        nodes.append(users[0])
        value = users[0].outputs[0]
        users = [u for u, _ in value.uses()]
    if len(users) == 1 and users[0].op_type == "Mul" and users[0].domain in STD:
        mul = users[0]
        for operand, factor_value in commuted(mul):
            factor = const_scalar(factor_value)
            if operand is value and factor is not None:
                need(factor > 0 and np.isfinite(factor), f"routing weights: scaled by {factor} ({mul.name})")
                nodes.append(mul)
                value, scaling = mul.outputs[0], factor
                break
    return value, normalized, scaling, nodes


def _bound(node: ir.Node) -> float | None:
    """The constant operand of ``Add`` / ``Max`` (either order) or ``Clip``'s ``min`` (no ``max``)."""
    if node.op_type == "Clip":
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            return None
        return const_scalar(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    for _, other in commuted(node):
        found = const_scalar(other)
        if found is not None:
            return found
    return None


def _other_sum(add: ir.Node) -> ir.Node | None:
    for operand, other in commuted(add):
        if const_scalar(other) is not None:
            return operand.producer()
    return None
