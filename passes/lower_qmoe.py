"""The ``ort-moe`` lowering quantized: ``com.microsoft.MoE`` → ``com.microsoft.QMoE`` (ONNX Runtime 1.32's schema).

``QuantizeWeights`` (``passes/quantize_weights.py``) calls ``quantize_ort_moe`` on every ``com.microsoft.MoE`` node
the ``ort-moe`` lowering (``passes/lower_moe.py``) wrote, after the lowering: the float ``fc1`` ``[E, 2F, H]``
(gate / up rows interleaved, ``swiglu_fusion=1``) and ``fc2`` ``[E, H, F]`` become codes ``[E, N, K * bits / 8]``
uint8 with block-wise scales ``[E, N, K / block]`` (the hidden dtype), in the one block format of
``quantize_weights.quantize_rows`` (blocks along K, the input feature axis, of each row; symmetric: the default
zero point ``2^(bits-1)``, no zero-point input; asymmetric: ``fc1_zero_points`` / ``fc2_zero_points``, inputs 11 /
12, packed like the codes). Biases, routing and every attribute (``k``, ``activation_type``, ``swiglu_fusion``,
``normalize_routing_weights``, ``activation_alpha`` / ``beta``, ``swiglu_limit``) carry over; added:
``expert_weight_bits``, ``block_size``, ``accuracy_level`` (4: int8 activations in ONNX Runtime's CPU kernel).

QMoE's inputs (1.32): 0 input, 1 router_probs, 2 fc1_experts_weights, 3 fc1_scales, 4 fc1_experts_bias,
5 fc2_experts_weights, 6 fc2_scales, 7 fc2_experts_bias, 8-10 fc3 (absent), 11 fc1_zero_points, 12 fc2_zero_points,
13 fc3_zero_points (absent), 14 router_weights: with ``normalize_routing_weights = 0`` the softmax of the router
logits over every expert (QMoE's CPU kernel renormalises the chosen experts' weights otherwise: measured).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes._builder import Builder
from layerzero.passes._graph import const_array, replace_value
from layerzero.passes._match import need

__all__ = ["quantize_ort_moe"]

MS_DOMAIN = "com.microsoft"
_COPIED = (
    "k",
    "activation_type",
    "swiglu_fusion",
    "normalize_routing_weights",
    "activation_alpha",
    "activation_beta",
    "swiglu_limit",
    "use_sparse_mixer",
)


def quantize_ort_moe(
    builder: Builder, graph: ir.Graph, node: ir.Node, bits: int, block: int, symmetric: bool, accuracy_level: int
) -> None:
    """Replace the ``com.microsoft.MoE`` ``node`` by ``QMoE`` on the same inputs' quantized weights (NoMatch:
    a weight that is not a constant, an fc3 input; ``InvalidInputError``: K not a multiple of ``block``)."""
    from layerzero.passes.quantize_weights import check_expert_block, pack_codes, quantize_rows  # one format

    inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
    x, probs, fc1, fc1_bias, fc2, fc2_bias = inputs[:6]
    need(all(v is None for v in inputs[6:]), "an fc3 input (QMoE is written for fused gate / up only)", node)
    weights = []
    for value in (fc1, fc2):
        array = const_array(value)
        need(array is not None and array.ndim == 3, f"expert weight {value and value.name} is not a constant 3-D", node)
        check_expert_block(node.name, value.name, array.shape[-1], block)
        weights.append(array)
    dtype = x.dtype.numpy() if x.dtype is not None else np.dtype(np.float32)
    scope = builder.sub(node.name.strip("/") or "qmoe", body=True)  # a tape of its own
    quantized: list[ir.Value | None] = []
    zero_points: list[ir.Value | None] = []
    for name, value, array in (("fc1", fc1, weights[0]), ("fc2", fc2, weights[1])):
        codes, scales, zp = quantize_rows(array, bits, block, symmetric)
        packed = pack_codes(codes.reshape(*codes.shape[:-2], -1), bits)
        hint = value.name or name
        quantized += [
            builder.initializer(f"{hint}_Q{bits}", packed),
            builder.initializer(f"{hint}_scales", scales.astype(dtype)),
        ]
        if zp is not None:
            zp = builder.initializer(f"{hint}_zp", pack_codes(zp, bits, pad=1 << (bits - 1)))
        zero_points.append(zp)
    qmoe_inputs: list[ir.Value | None] = [
        x, probs, quantized[0], quantized[1], fc1_bias, quantized[2], quantized[3], fc2_bias,
    ]  # fmt: skip
    qmoe_inputs += [None, None, None, zero_points[0], zero_points[1]]
    normalize = node.attributes.get("normalize_routing_weights")
    if normalize is not None and not normalize.value:
        # QMoE's CPU kernel renormalises the top-k weights whatever normalize_routing_weights says (measured, ORT
        # 1.32: y off by the renormalisation); router_weights (input 14) makes it mix by the softmax over every
        # expert, gathered at the chosen ones, which is what MoE computes with normalize_routing_weights = 0.
        weights = scope.op("Softmax", [probs], axis=-1)
        weights.dtype, weights.shape = probs.dtype, probs.shape
        qmoe_inputs += [None, weights]
    while qmoe_inputs[-1] is None:
        qmoe_inputs.pop()
    attrs: dict[str, object] = {k: node.attributes[k] for k in _COPIED if k in node.attributes}
    attrs.update(expert_weight_bits=bits, block_size=block, accuracy_level=accuracy_level)
    out = scope.op("QMoE", qmoe_inputs, domain=MS_DOMAIN, **attrs)
    old = node.outputs[0]
    out.dtype, out.shape = old.dtype, old.shape
    graph.insert_before(node, scope.take())
    replace_value(old, out, builder.names)
    graph.remove(node, safe=True)
    for value in (fc1, fc2):
        if not value.uses() and value.name in graph.initializers:
            graph.initializers.pop(value.name)
