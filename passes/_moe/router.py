"""The router part: scores, top-k selection, normalisation of the routing weights, the routing matrix.

Variants:
- scores (``ROUTER_VARIANTS``): ``TopK(Softmax(logits, -1) | Sigmoid(logits), k)`` (Mixtral, Qwen-MoE, OLMoE),
  or ``Softmax(TopK(logits, k).values)`` (GraniteMoE, JetMoE, GPT-OSS: the same weights as the first with
  ``normalize``), ``TopK`` over the last axis, ``largest=1``, logits ``[T, E]``;
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
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    need,
    rank_of,
    sorted_axes,
    static_dim,
)

__all__ = ["ROUTER_VARIANTS", "Router", "match_router", "router_candidate", "routing_matrix", "routing_weights"]


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
    need(attr_of(scores, "axis", -1) in (-1, 1), "router: the Softmax of the top-k logits is not over the k axis")
    return scores, topk.inputs[0], scores.outputs[0], True


# Router variants (rules as data): name -> part returning (scores node, logits [T, E], weights [T, k],
# normalized). Tried in order; the first that accepts the TopK wins.
ROUTER_VARIANTS = {"scores-topk": _scores_then_topk, "topk-softmax": _topk_then_softmax}


def router_candidate(topk: ir.Node, hops: int = 6) -> bool:
    """Whether a TopK looks like a router: its values feed a Softmax, or a Softmax / Sigmoid lies within
    ``hops`` producers above it (scores with a correction bias and group masks, DeepSeek-V3 / GLM4-MoE style).
    A candidate no variant matches is reported with the reason, not passed over in silence."""
    if any(u.op_type == "Softmax" and u.domain in STD for u, _ in topk.outputs[0].uses()):
        return True
    frontier = [topk.inputs[0]] if topk.inputs and topk.inputs[0] is not None else []
    for _ in range(hops):
        producers = [v.producer() for v in frontier if v is not None]
        producers = [p for p in producers if p is not None and p.domain in STD]
        if any(p.op_type in ("Softmax", "Sigmoid") for p in producers):
            return True
        frontier = [v for p in producers for v in p.inputs]
    return False


def match_router(topk: ir.Node) -> Router:
    """A router: ``TopK(k, axis=-1, largest=1)`` over logits ``[T, E]`` in one of ``ROUTER_VARIANTS``."""
    need(topk.op_type == "TopK" and topk.domain in STD, "not a TopK")
    reasons, found = [], None
    for name, part in ROUTER_VARIANTS.items():
        try:
            found = (name, *part(topk))
            break
        except NoMatch as exc:
            reasons.append(str(exc))
    need(found is not None, "; ".join(reasons))
    variant, scores, logits, values, normalized = found
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
    for hot_value, weights_value in commuted(mul):
        try:
            return w.attempt(lambda h=hot_value, v=weights_value: _one_hot_times(w, h, v, router))
        except NoMatch as exc:
            reason = str(exc)
    raise NoMatch(reason)


def _zeros_like_logits(w: Walk, value: ir.Value, router: Router) -> None:
    """``value`` is zeros of the logits' shape: ``ConstantOfShape(0)`` or ``Expand(0, shape)`` (torch's
    ``zeros``), of ``Shape(logits)`` or with the same inferred (symbolic) shape as the logits."""
    what = "routing matrix: the scattered-into tensor"
    node = w.node(value, ("ConstantOfShape", "Expand"), what)
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        zero = fill is None or not np.any(fill.value.numpy())
    else:
        fill = const_array(node.inputs[0])
        zero = fill is not None and fill.size == 1 and not np.any(fill)
    need(zero, f"{what} is not 0")
    w.shareable.add(node)
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
    need(same_shape(value, router.logits), f"{what} does not have the router logits' shape")


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
