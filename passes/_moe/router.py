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

import onnx_ir as ir

from layerzero.passes._graph import const_array, same_shape
from layerzero.passes._moe.routers.biased_select import biased_select
from layerzero.passes._moe.routers.common import Router
from layerzero.passes._moe.routers.scores_topk import scores_then_topk
from layerzero.passes._moe.routers.sparsemixer import match_sparsemixer, sparsemixer_head
from layerzero.passes._moe.routers.topk_sigmoid import topk_then_sigmoid
from layerzero.passes._moe.routers.topk_softmax import topk_then_softmax
from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    furthest_of,
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


# Router variants (rules as data): name -> part returning (scores node, logits [T, E], weights [T, k],
# normalized[, Router fields of the v2 routing]). Tried in order; the first that accepts the TopK wins.
ROUTER_VARIANTS = {
    "biased-select": biased_select,
    "scores-topk": scores_then_topk,
    "topk-softmax": topk_then_softmax,
    "topk-sigmoid": topk_then_sigmoid,
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
