"""PhiMoE's sparsemixer router (no TopK): two ArgMax choices, each weighed by a masked softmax."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._moe.routers.common import Router, filled, past_same_type_cast, reduces_rows, same_type_cast
from layerzero.passes._moe.walk import (
    STD,
    attr_of,
    commuted,
    const_scalar,
    near,
    need,
    rank_of,
    static_dim,
)

__all__ = ["match_sparsemixer", "sparsemixer_head"]


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
        and filled(scatter.inputs[2], nodes) == -np.inf,
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
    greater = past_same_type_cast(where.inputs[0], nodes).producer()
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
    need(reduces_rows(reducemax, "ReduceMax", current), f"{what}: the gap is not ReduceMax(choices) - logits")
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
            if producer is None or not same_type_cast(producer):
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
