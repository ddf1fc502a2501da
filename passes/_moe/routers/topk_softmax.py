"""Router variant ``topk-softmax``: the Softmax of the top-k logits."""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._moe.walk import STD, attr_of, need

__all__ = ["topk_then_softmax"]


def topk_then_softmax(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool]:
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
