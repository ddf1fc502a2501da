"""Router variant ``topk-sigmoid`` (Llama 4): the sigmoid of the top-k logits scattered into -inf."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import same_shape
from layerzero.passes._moe.routers.common import filled, through_same_type_casts
from layerzero.passes._moe.walk import STD, attr_of, need

__all__ = ["topk_then_sigmoid"]


def topk_then_sigmoid(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool, dict]:
    """``Sigmoid(ScatterElements(full(-inf), TopK(logits).indices, TopK(logits).values, axis 1))`` (Llama 4):
    the router's own ``[T, E]`` matrix, ``sigmoid`` of the chosen logits and 0 elsewhere (through same-type
    ``Cast``s, TorchScript's ``.float()`` / ``.to(dtype)``). The weights are the sigmoid of the top-k logits,
    which is the top-k of the sigmoid scores (a monotone function)."""
    values, indices = topk.outputs
    scatters = [u for u, i in values.uses() if i == 2 and u.op_type == "ScatterElements" and u.domain in STD]
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
        filled(scatter.inputs[0], nodes) == -np.inf,
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
    value = through_same_type_casts(scatter.outputs[0], nodes)
    users = [u for u, _ in value.uses()]
    need(
        len(users) == 1 and users[0].op_type == "Sigmoid" and users[0].domain in STD,
        f"router: the routing matrix {value.name} is not read by one Sigmoid",
        topk,
        *nodes,
    )
    sigmoid = users[0]
    matrix = through_same_type_casts(sigmoid.outputs[0], nodes)
    return sigmoid, topk.inputs[0], values, False, {"nodes": nodes, "matrix": matrix}
