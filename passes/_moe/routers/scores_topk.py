"""Router variant ``scores-topk``: ``TopK`` of the Softmax / Sigmoid scores."""

from __future__ import annotations

import onnx_ir as ir

from layerzero.passes._moe.walk import STD, need

__all__ = ["scores_then_topk"]


def scores_then_topk(topk: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value, bool]:
    """``TopK(Softmax(logits, -1) | Sigmoid(logits))`` (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
    scores_value = topk.inputs[0]
    scores = scores_value.producer() if scores_value is not None else None
    need(
        scores is not None and scores.op_type in ("Softmax", "Sigmoid") and scores.domain in STD,
        "router: TopK does not read Softmax or Sigmoid scores",
    )
    return scores, scores.inputs[0], topk.outputs[0], False
