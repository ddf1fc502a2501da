"""The router part: scores, top-k selection, normalisation of the routing weights, the routing matrix.

Variants:
- scores (``ROUTER_VARIANTS``): ``TopK(Softmax(logits, -1) | Sigmoid(logits), k)`` (Mixtral, Qwen-MoE, OLMoE),
  or ``Softmax(TopK(logits, k).values)`` (GraniteMoE, JetMoE, GPT-OSS: the same weights as the first with
  ``normalize``), ``TopK`` over the last axis, ``largest=1``, logits ``[T, E]``; or (``topk-sigmoid``,
  Llama 4) ``Sigmoid(ScatterElements(full(-inf), TopK(logits).indices, TopK(logits).values))``: the router's own
  ``[T, E]`` matrix (``Router.matrix``), which scales the experts' inputs;
- chosen by biased, group-limited scores, weighed by the unbiased ones (``biased-select``: DeepSeek-V3,
  GLM4-MoE, dots1 with sigmoid scores, Ernie-4.5-MoE with softmax scores)::

      s = scores + score_bias                                  (bias correction; absent once a zero bias folds)
      s = Where(group_mask, s, -inf)                           (group limits, optional; ``group_mask`` below)
      indices = TopK(s, k).indices;  w = GatherElements(scores, indices, axis=-1)
      w = w / ReduceSum(w) | w / (ReduceSum(w) + eps) | w / Clip(ReduceSum(w), min)     (optional)
      w = w * routed_scaling_factor                                                   (optional)

  ``group_mask``: ``Reshape(Expand(Unsqueeze(ScatterElements(zeros, TopK(ReduceSum(TopK(Reshape(s, [T, G,
  E/G]), 2).values, -1), topk_group).indices, ones), -1)), [T, E])`` through ``Cast`` / ``Not`` (either
  polarity of the ``Where``), as both exporters write it; ``n_group`` = G;
- PhiMoE's sparsemixer (no TopK; ``match_sparsemixer``, ``routing="sparsemixer"``): ``ArgMax`` of the logits,
  weighed by a softmax of the logits near the maximum, then the same with the first choice at -inf;
- routing weights: the top-k values (``normalize`` 0) or the values divided by their sum (1);
- routing matrix ``[T, E]`` (dense and unrolled blocks): ``ScatterElements(zeros, indices, weights, axis=1)``
  (zeros: ``ConstantOfShape(Shape(logits))`` or ``Expand(0, shape)``) or
  ``ReduceSum(OneHot(indices, E) * weights[..., None], axis=1)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array, same_shape
from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    const_scalar,
    furthest_of,
    near,
    need,
    rank_of,
    reshape_dims,
    sorted_axes,
    static_dim,
    zeros_node,
)

__all__ = [
    "ROUTER_VARIANTS",
    "Router",
    "match_router",
    "match_sparsemixer",
    "router_candidate",
    "routing_matrix",
    "routing_weights",
    "sparsemixer_head",
]

# ``+ eps`` before a normalisation's division that the skipping form's own ``+ 1e-20`` stands for
# (plugins/reference.py, NORMALIZE_EPS): DeepSeek-V3 / GLM4-MoE / dots1 write exactly 1e-20.
_NORMALIZE_EPS = 1e-20


@dataclasses.dataclass
class Router:
    topk: ir.Node
    scores: ir.Node  # Softmax | Sigmoid (of the logits, or of the top-k logits: ``variant``)
    logits: ir.Value  # [T, E]
    values: ir.Value  # the top-k routing weights [T, k] (before any renormalisation Div)
    indices: ir.Value  # TopK indices
    top_k: int
    experts: int
    scoring: str  # "softmax" | "sigmoid"
    variant: str = "scores-topk"  # a key of ROUTER_VARIANTS
    # ``values`` are already the top-k probabilities renormalised to sum 1 (a softmax of the k logits is the
    # softmax over all experts restricted to the top k and renormalised: ``normalize`` 1 of the skipping form).
    normalized: bool = False
    # v2 routing (``biased-select``): the selection bias [E], group limits, the routed scaling factor, and the
    # router's other nodes (selection, gather, normalisation, scaling), removed with the block once dead.
    score_bias: np.ndarray | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)
    routing: str = "topk"  # "sparsemixer": PhiMoE (``topk`` is then the first ArgMax)
    jitter_eps: float = 0.01
    # ``topk-sigmoid`` (Llama 4): the routing matrix [T, E] the router builds itself (the sigmoid of the top-k
    # logits scattered into -inf), which scales each expert's INPUT, not its output.
    matrix: ir.Value | None = None


def _scores_then_topk(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool]:
    """``TopK(Softmax(logits, -1) | Sigmoid(logits))`` (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
    scores_value = topk.inputs[0]
    scores = scores_value.producer() if scores_value is not None else None
    need(
        scores is not None and scores.op_type in ("Softmax", "Sigmoid") and scores.domain in STD,
        "router: TopK does not read Softmax or Sigmoid scores",
    )
    return scores, scores.inputs[0], topk.outputs[0], False


def _topk_then_softmax(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool]:
    """``Softmax(TopK(logits).values, -1)`` (GraniteMoE, JetMoE, GPT-OSS): the k logits' softmax."""
    values = topk.outputs[0]
    users = [u for u, _ in values.uses()]
    need(
        len(users) == 1 and users[0].op_type == "Softmax" and users[0].domain in STD,
        "router: the top-k logits are not read by one Softmax",
    )
    scores = users[0]
    need(
        attr_of(scores, "axis", -1) in (-1, 1),
        "router: the Softmax of the top-k logits is not over the k axis",
        topk,
        scores,
    )
    return scores, topk.inputs[0], scores.outputs[0], True


def _biased_select(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool, dict]:
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
    scores = _past_same_type_cast(scores_value, extra["nodes"]).producer()
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
        select, extra["n_group"], extra["topk_group"], group_nodes = _group_mask(where, experts)
        extra["nodes"].extend([where, *group_nodes])
    if select is not scores_value:
        add = select.producer()
        need(
            add is not None and add.op_type == "Add" and add.domain in STD,
            f"router: TopK {topk.name} chooses by neither the gathered scores nor scores + a bias",
        )
        for operand, bias_value in commuted(add):
            bias = _through_identity(bias_value)
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
    values, normalized, scaling, weight_nodes = _gathered_weights(gather.outputs[0], scores.op_type, k, experts)
    extra["nodes"].extend(weight_nodes)
    extra["routed_scaling_factor"] = scaling
    return scores, scores.inputs[0], values, normalized, extra


def _topk_then_sigmoid(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool, dict]:
    """``Sigmoid(ScatterElements(full(-inf), TopK(logits).indices, TopK(logits).values, axis 1))`` (Llama 4):
    the router's own ``[T, E]`` matrix, ``sigmoid`` of the chosen logits and 0 elsewhere (through same-type
    ``Cast``s, TorchScript's ``.float()`` / ``.to(dtype)``). The weights are the sigmoid of the top-k logits,
    which is the top-k of the sigmoid scores (a monotone function)."""
    values, indices = topk.outputs
    scatters = [
        u for u, i in values.uses() if i == 2 and u.op_type == "ScatterElements" and u.domain in STD
    ]
    need(len(scatters) == 1, "router: the top-k logits are not scattered into a routing matrix")
    scatter = scatters[0]
    need(
        scatter.inputs[1] is indices
        and attr_of(scatter, "axis", 0) in (-1, 1)
        and attr_of(scatter, "reduction", "none") == "none",
        f"router: ScatterElements {scatter.name} does not put the top-k logits at their experts",
        topk,
        scatter,
    )
    nodes: list[ir.Node] = [scatter]
    need(
        _filled(scatter.inputs[0], nodes) == -np.inf,
        f"router: ScatterElements {scatter.name} does not scatter into -inf (the sigmoid's 0)",
        topk,
        scatter,
    )
    fill = scatter.inputs[0].producer()
    shape = None if fill is None or not fill.inputs else fill.inputs[-1].producer()
    need(
        (shape is not None and shape.op_type == "Shape" and shape.inputs[0] is topk.inputs[0] and not shape.attributes)
        or same_shape(scatter.inputs[0], topk.inputs[0]),
        f"router: the -inf matrix of {scatter.name} does not have the logits' shape",
        topk,
        scatter,
    )
    value = scatter.outputs[0]
    for _ in range(3):
        users = [u for u, _ in value.uses()]
        if len(users) != 1 or not _same_type_cast(users[0]):
            break
        nodes.append(users[0])
        value = users[0].outputs[0]
    users = [u for u, _ in value.uses()]
    need(
        len(users) == 1 and users[0].op_type == "Sigmoid" and users[0].domain in STD,
        f"router: the routing matrix {value.name} is not read by one Sigmoid",
        topk,
        *nodes,
    )
    sigmoid = users[0]
    matrix = sigmoid.outputs[0]
    for _ in range(3):
        users = [u for u, _ in matrix.uses()]
        if len(users) != 1 or not _same_type_cast(users[0]):
            break
        nodes.append(users[0])
        matrix = users[0].outputs[0]
    return sigmoid, topk.inputs[0], values, False, {"nodes": nodes, "matrix": matrix}


def _same_type_cast(node: ir.Node) -> bool:
    """A ``Cast`` to the type its input already has (TorchScript's ``.float()`` of a float32 tensor)."""
    if node.op_type != "Cast" or node.domain not in STD or node.inputs[0] is None:
        return False
    to = attr_of(node, "to")
    return to is not None and node.inputs[0].dtype is not None and ir.DataType(to) == node.inputs[0].dtype


def _past_same_type_cast(value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """``value``, or the input of the same-type ``Cast`` producing it (appended to ``nodes``)."""
    producer = value.producer()
    if producer is not None and _same_type_cast(producer):
        nodes.append(producer)
        return producer.inputs[0]
    return value


def _through_identity(value: ir.Value | None) -> np.ndarray | None:
    """A constant, also behind ``Identity`` (TorchScript shares an equal initializer between layers so)."""
    producer = None if value is None else value.producer()
    while producer is not None and producer.op_type == "Identity" and producer.domain in STD:
        value = producer.inputs[0]
        producer = value.producer()
    return const_array(value)


def _group_mask(where: ir.Node, experts: int) -> tuple[ir.Value, int, int, list[ir.Node]]:
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
            need(to is not None and ir.DataType(to) in _MASK_TYPES, f"{what}: Cast {node.name} to {to}")
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
    need(_filled(scatter.inputs[0], nodes) == 0, f"{what}: the group mask is not scattered into zeros")
    ones = _filled(scatter.inputs[2], nodes)
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


_MASK_TYPES = (ir.DataType.BOOL, ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.INT64, ir.DataType.INT32)


def _filled(value: ir.Value, nodes: list[ir.Node]) -> float | None:
    """The one value a constant-filled tensor holds: a scalar constant, ``ConstantOfShape(value)`` or
    ``Expand(scalar, shape)`` (torch's ``zeros_like`` / ``expand``); None otherwise."""
    scalar = const_scalar(value)
    if scalar is not None:
        return scalar
    node = value.producer()
    if node is None or node.domain not in STD:
        return None
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        found = 0.0 if fill is None else float(fill.value.numpy().reshape(-1)[0])
    elif node.op_type == "Expand":
        found = const_scalar(node.inputs[0])
    else:
        return None
    if found is not None:
        nodes.append(node)
    return found


def _gathered_weights(
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
                    (bound is not None and 0 <= bound <= _NORMALIZE_EPS * (1 + 1e-6))
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
            total is not None
            and total.op_type == "ReduceSum"
            and total.inputs[0] is value
            and sorted_axes(axes_of(total), 2) == [1]
            and attr_of(total, "keepdims", 1) == 1,
            f"routing weights: Div {div.name} does not divide by the sum of the gathered weights",
        )
        nodes.extend([total, div])
        value, normalized = div.outputs[0], True
    users = [u for u, _ in value.uses()]
    if len(users) == 1 and _same_type_cast(users[0]):  # TorchScript's .to(hidden dtype) of float32 weights
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


# Router variants (rules as data): name -> part returning (scores node, logits [T, E], weights [T, k],
# normalized[, Router fields of the v2 routing]). Tried in order; the first that accepts the TopK wins.
ROUTER_VARIANTS = {
    "biased-select": _biased_select,
    "scores-topk": _scores_then_topk,
    "topk-softmax": _topk_then_softmax,
    "topk-sigmoid": _topk_then_sigmoid,
}


def router_candidate(topk: ir.Node, hops: int = 6) -> bool:
    """Whether a TopK looks like a router: its values feed a Softmax, or a Softmax / Sigmoid lies within
    ``hops`` producers above it (scores with a correction bias and group masks, DeepSeek-V3 / GLM4-MoE style).
    A candidate no variant matches is reported with the reason, not passed over in silence."""
    if any(u.op_type == "Softmax" and u.domain in STD for u, _ in topk.outputs[0].uses()):
        return True
    for user, _ in topk.outputs[0].uses():  # Llama 4: the top-k logits scattered, then a Sigmoid
        if user.op_type == "ScatterElements" and user.domain in STD:
            value = user.outputs[0]
            for _ in range(3):
                readers = [u for u, _ in value.uses()]
                if any(u.op_type == "Sigmoid" for u in readers):
                    return True
                if len(readers) != 1 or readers[0].op_type != "Cast":
                    break
                value = readers[0].outputs[0]
    frontier = [topk.inputs[0]] if topk.inputs and topk.inputs[0] is not None else []
    for _ in range(hops):
        producers = [v.producer() for v in frontier if v is not None]
        producers = [p for p in producers if p is not None and p.domain in STD]
        if any(p.op_type in ("Softmax", "Sigmoid") for p in producers):
            return True
        frontier = [v for p in producers for v in p.inputs]
    return False


def sparsemixer_head(node: ir.Node) -> bool:
    """Whether ``node`` is the first ``ArgMax`` of a PhiMoE sparsemixer (not the second: that one reads the
    logits with the first choice scattered to -inf)."""
    if node.op_type != "ArgMax" or node.domain not in STD or node.inputs[0] is None:
        return False
    producer = node.inputs[0].producer()
    if producer is not None and producer.op_type == "ScatterElements":
        return False
    return any(u.op_type == "GatherElements" and i == 1 for u, i in node.outputs[0].uses())


def match_sparsemixer(first: ir.Node) -> Router:
    """PhiMoE's sparsemixer at inference (``plugins/reference.py`` ``_sparsemixer``)::

    i1 = ArgMax(s); w1 = GatherElements(Softmax(Where(far(ReduceMax(s)), -inf, s)), i1)
    s2 = ScatterElements(s, i1, -inf)
    i2 = ArgMax(s2); w2 = GatherElements(Softmax(Where(far(ReduceMax(s2)), -inf, s2)), i2)
    weights = Concat(w1, w2, -1); indices = Concat(i1, i2, -1)
    far(m) = Greater(Div(Sub(m, s), Max(Abs(s), m)), 2·jitter_eps)       (through Casts to the same type)
    """
    logits = first.inputs[0]
    nodes: list[ir.Node] = []
    g1, soft1, eps1 = _sparse_choice(first, logits, logits, nodes)
    scatter = [u for u, i in first.outputs[0].uses() if i == 1 and u.op_type == "ScatterElements"]
    need(len(scatter) == 1, f"sparsemixer: the first choice ArgMax {first.name} is not scattered to -inf once")
    scatter = scatter[0]
    need(
        scatter.inputs[0] is logits
        and attr_of(scatter, "axis", 0) in (-1, 1)
        and attr_of(scatter, "reduction", "none") == "none"
        and _filled(scatter.inputs[2], nodes) == -np.inf,
        f"sparsemixer: ScatterElements {scatter.name} does not set the first choice's logit to -inf",
    )
    nodes.append(scatter)
    seconds = [u for u, _ in scatter.outputs[0].uses() if u.op_type == "ArgMax" and u.domain in STD]
    need(len(seconds) == 1, "sparsemixer: no second choice (ArgMax of the logits without the first)")
    second = seconds[0]
    g2, _, eps2 = _sparse_choice(second, scatter.outputs[0], logits, nodes)
    need(near(eps1, eps2), f"sparsemixer: the two choices use different jitter eps ({eps1}, {eps2})")
    values = _one_concat(g1.outputs[0], g2.outputs[0], "weights")
    indices = _one_concat(first.outputs[0], second.outputs[0], "indices")
    nodes.extend([g1, g2, second, values.producer(), indices.producer()])
    need(rank_of(logits) == 2, f"router: logits {logits.name} have rank {rank_of(logits)}, expected [tokens, experts]")
    experts = static_dim(logits, 1)
    need(experts is not None and experts >= 2, f"router: the number of experts (dim 1 of {logits.name}) is not static")
    return Router(
        topk=first,
        scores=soft1,
        logits=logits,
        values=values,
        indices=indices,
        top_k=2,
        experts=experts,
        scoring="softmax",
        variant="sparsemixer",
        nodes=nodes,
        routing="sparsemixer",
        jitter_eps=eps1,
    )


def _sparse_choice(
    argmax: ir.Node, current: ir.Value, logits: ir.Value, nodes: list[ir.Node]
) -> tuple[ir.Node, ir.Node, float]:
    """One choice of the sparsemixer: ``(GatherElements, Softmax, jitter_eps)``."""
    what = f"sparsemixer (ArgMax {argmax.name})"
    need(
        argmax.inputs[0] is current
        and attr_of(argmax, "axis", 0) in (-1, 1)
        and attr_of(argmax, "keepdims", 1) == 1
        and attr_of(argmax, "select_last_index", 0) == 0,
        f"{what}: not the first maximum over the experts, kept as [T, 1]",
    )
    gathers = [u for u, i in argmax.outputs[0].uses() if i == 1 and u.op_type == "GatherElements"]
    need(len(gathers) == 1, f"{what}: the choice does not gather one weight")
    gather = gathers[0]
    softmax = gather.inputs[0].producer()
    need(
        softmax is not None and softmax.op_type == "Softmax" and attr_of(softmax, "axis", -1) in (-1, 1),
        f"{what}: the weight is not gathered from a Softmax over the experts",
    )
    where = softmax.inputs[0].producer()
    need(where is not None and where.op_type == "Where", f"{what}: the Softmax does not read a masked Where")
    need(
        const_scalar(where.inputs[1]) == -np.inf and where.inputs[2] is current,
        f"{what}: Where {where.name} does not set the far logits to -inf",
    )
    greater = _past_same_type_cast(where.inputs[0], nodes).producer()
    if greater is not None and greater.op_type == "Cast" and attr_of(greater, "to") == ir.DataType.BOOL:
        nodes.append(greater)
        greater = greater.inputs[0].producer()
    need(greater is not None and greater.op_type == "Greater", f"{what}: the mask is not a Greater")
    threshold = const_scalar(greater.inputs[1])
    need(threshold is not None and threshold >= 0, f"{what}: the mask's bound is not a constant >= 0")
    div = greater.inputs[0].producer()
    need(div is not None and div.op_type == "Div", f"{what}: the mask does not compare a relative gap (Div)")
    sub, factor = div.inputs[0].producer(), div.inputs[1].producer()
    reducemax = current_max = None
    if sub is not None and sub.op_type == "Sub" and sub.inputs[1] is logits:
        reducemax = sub.inputs[0].producer()
    need(
        reducemax is not None
        and reducemax.op_type == "ReduceMax"
        and reducemax.inputs[0] is current
        and sorted_axes(axes_of(reducemax), 2) == [1]
        and attr_of(reducemax, "keepdims", 1) == 1,
        f"{what}: the gap is not ReduceMax(choices) - logits",
    )
    current_max = reducemax.outputs[0]
    need(factor is not None and factor.op_type == "Max", f"{what}: the gap is not divided by Max(|logits|, max)")
    found = False
    for a, b in commuted(factor):
        abs_node = a.producer()
        if abs_node is None or abs_node.op_type != "Abs" or abs_node.inputs[0] is not logits:
            continue
        chain: list[ir.Node] = []
        value = b
        while value is not current_max:
            producer = value.producer()
            if producer is None or not _same_type_cast(producer):
                break
            chain.append(producer)
            value = producer.inputs[0]
        if value is current_max:
            nodes.extend([abs_node, *chain])
            found = True
            break
    need(found, f"{what}: the gap is not divided by Max(|logits|, max)")
    nodes.extend([where, greater, div, sub, factor, reducemax, softmax, argmax])
    return gather, softmax, threshold / 2


def _one_concat(a: ir.Value, b: ir.Value, what: str) -> ir.Value:
    concats = [u for u, i in a.uses() if i == 0 and u.op_type == "Concat"]
    need(
        len(concats) == 1
        and len(concats[0].inputs) == 2
        and concats[0].inputs[1] is b
        and attr_of(concats[0], "axis", 0) in (-1, 1),
        f"sparsemixer: the two choices' {what} are not concatenated in order",
    )
    return concats[0].outputs[0]


def match_router(topk: ir.Node) -> Router:
    """A router: ``TopK(k, axis=-1, largest=1)`` over logits ``[T, E]`` in one of ``ROUTER_VARIANTS``, or the
    first ``ArgMax`` of PhiMoE's sparsemixer (``match_sparsemixer``)."""
    if topk.op_type == "ArgMax":
        return match_sparsemixer(topk)
    need(topk.op_type == "TopK" and topk.domain in STD, "not a TopK")
    attempts, found = Attempts(), None
    for name, part in ROUTER_VARIANTS.items():
        with attempts.trying():
            found = (name, *part(topk))
            break
    if found is None:
        # The variant that got furthest (matched most of its nodes) says why; where none got past the TopK,
        # each variant's reason.
        raise furthest_of(attempts)
    variant, scores, logits, values, normalized, *more = found
    extra = more[0] if more else {}
    rank = rank_of(logits)
    need(rank == 2, f"router: logits {logits.name} have rank {rank}, expected [tokens, experts]")
    experts = static_dim(logits, 1)
    need(experts is not None, f"router: the number of experts (dim 1 of {logits.name}) is not static")
    if scores.op_type == "Softmax" and not normalized:
        need(attr_of(scores, "axis", -1) in (-1, 1), "router: Softmax is not over the experts axis")
    need(attr_of(topk, "axis", -1) in (-1, 1), "router: TopK is not over the experts axis")
    need(attr_of(topk, "largest", 1) == 1, "router: TopK takes the smallest scores (largest=0)")
    k = const_ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    need(k is not None and len(k) == 1, "router: TopK's k is not a constant")
    need(1 <= k[0] <= experts, f"router: k={k[0]} is outside 1..{experts}")
    return Router(
        topk=topk,
        scores=scores,
        logits=logits,
        values=values,
        indices=topk.outputs[1],
        top_k=k[0],
        experts=experts,
        scoring=scores.op_type.lower(),
        variant=variant,
        normalized=normalized,
        **extra,
    )


def routing_weights(w: Walk, value: ir.Value, router: Router) -> int:
    """``normalize`` of the routing weights ``value``: the top-k values (0), or values / their sum (1)."""
    if value is router.values:
        return int(router.normalized)
    div = w.node(value, "Div", "routing weights")
    need(div.inputs[0] is router.values, "routing weights: the Div does not divide the router's top-k values")
    total = w.node(div.inputs[1], "ReduceSum", "routing weights: the divisor")
    w.shareable.update((div, total))
    need(total.inputs[0] is router.values, "routing weights: the divisor is not the sum of the top-k values")
    need(sorted_axes(axes_of(total), 2) == [1], "routing weights: the divisor does not sum over the top-k axis")
    need(attr_of(total, "keepdims", 1) == 1, "routing weights: the divisor's ReduceSum drops the axis")
    return 1


def routing_matrix(w: Walk, value: ir.Value, router: Router) -> int:
    """A ``[T, E]`` matrix holding the routing weights at the top-k experts and 0 elsewhere."""
    node = w.node(value, ("ScatterElements", "ReduceSum"), "routing matrix")
    if node.op_type == "ScatterElements":
        need(attr_of(node, "axis", 0) in (1, -1), "routing matrix: ScatterElements is not along the experts axis")
        need(attr_of(node, "reduction", "none") == "none", "routing matrix: ScatterElements reduces")
        need(node.inputs[1] is router.indices, "routing matrix: scattered at other indices than the router's")
        _zeros_like_logits(w, node.inputs[0], router)
        return routing_weights(w, node.inputs[2], router)
    # ReduceSum(OneHot(indices, E) * Unsqueeze(weights, -1), axis=1)
    need(sorted_axes(axes_of(node), 3) == [1], "routing matrix: the one-hot sum is not over the top-k axis")
    need(attr_of(node, "keepdims", 1) == 0, "routing matrix: the one-hot sum keeps the top-k axis")
    mul = w.node(node.inputs[0], "Mul", "routing matrix: one-hot × weights")
    attempts = Attempts()
    for hot_value, weights_value in commuted(mul):
        with attempts.trying():
            return w.attempt(lambda h=hot_value, v=weights_value: _one_hot_times(w, h, v, router))
    raise furthest_of(attempts, ties="last")


def _zeros_like_logits(w: Walk, value: ir.Value, router: Router) -> None:
    """``value`` is zeros of the logits' shape: ``ConstantOfShape(0)`` or ``Expand(0, shape)`` (torch's
    ``zeros``), of ``Shape(logits)`` or with the same inferred (symbolic) shape as the logits."""
    what = "routing matrix: the scattered-into tensor"
    node = zeros_node(w, value, what)
    source = node.inputs[1] if node.op_type == "Expand" else node.inputs[0]
    shape_of = source.producer()
    if (
        shape_of is not None
        and shape_of.op_type == "Shape"
        and not shape_of.attributes
        and shape_of.inputs[0] in (router.logits, router.scores.outputs[0])
    ):
        w.nodes.append(shape_of)
        w.shareable.add(shape_of)
        return
    if _rows_by_experts(w, source, router):
        return
    need(same_shape(value, router.logits), f"{what} does not have the router logits' shape")


def _rows_by_experts(w: Walk, shape: ir.Value, router: Router) -> bool:
    """Whether ``shape`` is ``[T, E]`` built as TorchScript writes ``torch.zeros(x.shape[0], E)``:
    ``Concat(Unsqueeze(Gather(Shape(x), 0)), [E])`` with ``x`` a value the logits are computed from row by row
    (``_same_rows``). The shape's nodes join the walk as shareable."""
    concat = shape.producer()
    if concat is None or concat.op_type != "Concat" or concat.domain not in STD or len(concat.inputs) != 2:
        return False
    if const_ints(concat.inputs[1]) != [router.experts]:
        return False
    nodes = [concat]
    rows = concat.inputs[0]
    producer = rows.producer()
    if producer is not None and producer.op_type == "Unsqueeze" and sorted_axes(axes_of(producer), 1) == [0]:
        nodes.append(producer)
        rows = producer.inputs[0]
        producer = rows.producer()
    if producer is None or producer.op_type != "Gather" or attr_of(producer, "axis", 0) != 0:
        return False
    if const_ints(producer.inputs[1]) != [0]:
        return False
    nodes.append(producer)
    shape_of = producer.inputs[0].producer()
    if shape_of is None or shape_of.op_type != "Shape" or attr_of(shape_of, "start", 0) != 0:
        return False
    if not _same_rows(shape_of.inputs[0], router.logits):
        return False
    nodes.append(shape_of)
    w.nodes.extend(n for n in nodes if n not in w.nodes)
    w.shareable.update(nodes)
    return True


def _same_rows(x: ir.Value, logits: ir.Value, depth: int = 6) -> bool:
    """Whether ``logits`` has the rows of ``x``: ``x`` itself, or computed from it by ``MatMul`` / ``Gemm``
    (its first operand), ``Cast`` / ``Identity``, a ``Reshape`` to ``[-1, H]`` of a ``[T, H]`` value, or the
    scores' ``Softmax`` / ``Sigmoid`` over the last axis."""
    value = logits
    for _ in range(depth):
        if rank_of(value) != 2:
            return False  # Shape(x)[0] is the rows of a [T, H] value only
        if value is x:
            return True
        node = value.producer()
        if node is None or node.domain not in STD:
            return False
        if node.op_type == "Reshape":
            dims, h = reshape_dims(node), static_dim(node.inputs[0], 1)
            if rank_of(node.inputs[0]) != 2 or dims is None or len(dims) != 2 or h is None or dims[1] != h:
                return False
        elif node.op_type == "Gemm":
            if attr_of(node, "transA", 0):
                return False
        elif node.op_type not in ("MatMul", "Cast", "Identity"):
            return False
        value = node.inputs[0]
    return value is x and rank_of(x) == 2


def _one_hot_times(w: Walk, hot_value: ir.Value, weights_value: ir.Value, router: Router) -> int:
    hot = w.node(hot_value, ("OneHot", "Cast"), "routing matrix: one-hot")
    if hot.op_type == "Cast":
        hot = w.node(hot.inputs[0], "OneHot", "routing matrix: one-hot")
    need(hot.inputs[0] is router.indices, "routing matrix: one-hot of other indices than the router's")
    need(attr_of(hot, "axis", -1) in (-1, 2), "routing matrix: one-hot axis is not last")
    depth = const_array(hot.inputs[1])
    need(
        depth is not None and depth.size == 1 and int(depth.reshape(-1)[0]) == router.experts,
        "routing matrix: one-hot depth is not the number of experts",
    )
    values = const_array(hot.inputs[2])
    need(values is not None and values.reshape(-1).tolist() == [0, 1], "routing matrix: one-hot values are not [0, 1]")
    unsq = w.node(weights_value, "Unsqueeze", "routing matrix: weights[..., None]")
    need(sorted_axes(axes_of(unsq), 3) == [2], "routing matrix: weights are not unsqueezed on the last axis")
    return routing_weights(w, unsq.inputs[0], router)
