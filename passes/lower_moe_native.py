"""The ``native`` MoE lowering: keep ``ai.layerzero::MoE`` for ``liblayerzero_ort.so``; and ``auto``'s cost model.

``native`` leaves the skipping form in the graph for ONNX Runtime to run with the custom-op library
(``plugins/ort``): routing and the routed experts in one kernel, weights read in place from the initializers in
the form's own ``[out, in]`` layout, which is the kernel's access order (rows streamed), so nothing is re-laid
out. The node gains the run-time threshold ``layerzero::threshold`` in its own slot, input 9, after the v2 slots
5-8 (empty where absent; ``passes/_moe_node.py`` lays the node out).

``auto`` (``choose_auto``): ``native`` when the library is present and implements the block; otherwise the
faster of ``if`` and ``ort-moe`` by ``estimate_ms``, a cost model fitted to ``bench/moe.py`` measurements.

This module knows no file system: whether the library is present is the caller's argument (``native_present``:
the onnxruntime target looks for the library, ``compiler/targets/onnxruntime.py``).
"""

from __future__ import annotations

import dataclasses
import logging

import onnx_ir as ir

from layerzero.passes._dynamic import MOE_DOMAIN, threshold_input
from layerzero.passes._moe_node import QUANT_BLOCK, SCALE_SLOTS, THRESHOLD_SLOT, WEIGHT_FORMATS, MoENode

__all__ = [
    "NATIVE_ACTIVATIONS",
    "NATIVE_ATTRIBUTES",
    "NATIVE_SCORINGS",
    "BlockShape",
    "choose_auto",
    "choose_by_cost",
    "estimate_ms",
    "lower_native",
    "native_supports",
]

logger = logging.getLogger(__name__)

#: What liblayerzero_ort.so implements (plugins/ort/src/custom_op.cpp, moe_op_v2); anything else stays with If.
NATIVE_ATTRIBUTES = frozenset(
    {
        "top_k",
        "normalize",
        "scoring",
        "activation",
        "zeroing_threshold",
        "path",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "routing",
        "activation_alpha",
        "activation_limit",
        "weight_format",
        "block_size",
        "code_layout",
    }
)
NATIVE_SCORINGS = ("softmax", "sigmoid")
NATIVE_ACTIVATIONS = ("silu", "gelu", "relu", "swiglu_oai")
_NATIVE_WEIGHTS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_NATIVE_HIDDEN = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
# The v2 optional inputs (position -> name; passes/_moe_node.py lays them out): expert biases and the selection
# bias; the kernel reads the run-time threshold as input 9 after them.
_V2_INPUTS = {5: "b_gate", 6: "b_up", 7: "b_down", 8: "score_bias"}


def native_supports(node: ir.Node) -> str | None:
    """Why liblayerzero_ort.so cannot run this ``ai.layerzero::MoE`` node (None when it can).

    The kernel implements moe_op_v2 (expert biases, ``swiglu_oai``, selection bias, group-limited top-k, routed
    scaling) except ``routing`` other than ``topk`` (PhiMoE's sparsemixer), with float experts or quantized ones
    (``weight_format`` q8: int8 codes, q4: uint8 nibbles, float16 scales at 10-12, ``block_size`` 32). Refused:
    that, any attribute it does not know, other dtypes, and weights, scales or v2 inputs that are not constants no
    feed can override.
    """
    view = MoENode.of(node)
    v2 = view.v2_inputs
    for value in (view.w_gate, view.w_up, view.w_down, *v2.values()):
        if value is not None and value.is_graph_input():
            return f"expert weight {value.name} is also a graph input (a feed may override it)"
    if view.routing != "topk":
        return f"routing {view.routing!r} (liblayerzero_ort.so implements routing = 'topk' only)"
    unknown = sorted(set(node.attributes) - NATIVE_ATTRIBUTES)
    if unknown:
        known = ", ".join(sorted(NATIVE_ATTRIBUTES))
        return f"attributes {', '.join(unknown)} (liblayerzero_ort.so implements {known})"
    if view.weight_format not in WEIGHT_FORMATS:
        return f"weight_format {view.weight_format!r} (liblayerzero_ort.so implements {', '.join(WEIGHT_FORMATS)})"
    if view.code_layout not in ("rows", "chunk16") or (view.code_layout == "chunk16" and view.weight_format != "q4"):
        return (
            f"code_layout {view.code_layout!r} with weight_format {view.weight_format!r} (liblayerzero_ort.so: rows, "
            "or chunk16 for q4)"
        )
    for name, allowed, default in (("scoring", NATIVE_SCORINGS, "softmax"), ("activation", NATIVE_ACTIVATIONS, "silu")):
        attr = node.attributes.get(name)
        value = default if attr is None else str(attr.value)
        if value not in allowed:
            return f"{name} {value!r} (liblayerzero_ort.so implements {', '.join(allowed)})"
    if view.quantized:
        return _quantized_supports(view, len(node.inputs))
    if len(node.inputs) > THRESHOLD_SLOT + 1:
        return f"{len(node.inputs)} inputs (liblayerzero_ort.so implements 5, the v2 inputs 5-8 and the threshold)"
    hidden = node.inputs[0]
    if hidden is None or hidden.dtype not in _NATIVE_HIDDEN:
        return f"hidden dtype {hidden and hidden.dtype} (float32 or float16)"
    why = _v2_supports(v2)
    if why is not None:
        return why
    dtypes = set()
    for value in node.inputs[2:5]:
        if value is None or value.const_value is None:
            return f"expert weight {value and value.name} is not a constant"
        dtypes.add(value.const_value.dtype)
    if len(dtypes) != 1 or next(iter(dtypes)) not in _NATIVE_WEIGHTS:
        return f"expert weight dtypes {sorted(str(d) for d in dtypes)} (one of float32, float16, bfloat16)"
    return None


def _v2_supports(v2: dict[int, ir.Value]) -> str | None:
    for i, value in v2.items():
        if value.const_value is None:
            return f"{_V2_INPUTS[i]} {value.name} is not a constant"
        if value.const_value.dtype not in _NATIVE_WEIGHTS:
            return f"{_V2_INPUTS[i]} dtype {value.const_value.dtype} (one of float32, float16, bfloat16)"
    return None


def _quantized_supports(view: MoENode, inputs: int) -> str | None:
    """Why the kernel cannot run these quantized experts (None when it can): codes int8 (q8) / uint8 (q4) at 2-4,
    float16 scales at 10-12 (blocks of 32 along each row), all constants."""
    if view.block_size != QUANT_BLOCK:
        return f"block_size {view.block_size} (liblayerzero_ort.so implements {QUANT_BLOCK})"
    hidden = view.hidden
    if hidden.dtype not in _NATIVE_HIDDEN:
        return f"hidden dtype {hidden.dtype} (float32 or float16)"
    code_type = ir.DataType.INT8 if view.weight_format == "q8" else ir.DataType.UINT8
    for name in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
        value = getattr(view, name)
        if value is None or value.const_value is None:
            return f"{name} {value and value.name} is not a constant"
        want = code_type if name.startswith("w_") else ir.DataType.FLOAT16
        if value.const_value.dtype != want:
            return f"{name} {value.name} is {value.const_value.dtype}, {view.weight_format} needs {want}"
    if inputs != SCALE_SLOTS[-1] + 1:
        return f"{inputs} inputs ({view.weight_format} takes {SCALE_SLOTS[-1] + 1}: the scales at 10-12)"
    return _v2_supports(view.v2_inputs)


def lower_native(model: ir.Model, node: ir.Node, default_threshold: float) -> None:
    """Keep ``node`` for the custom op; the run-time threshold ``layerzero::threshold`` goes into its slot, input 9
    (``passes/_moe_node.py``: the v2 slots 5-8 before it stay as they are, empty where absent)."""
    # MoE(x, logits, w_gate, w_up, w_down[, b.., sb])   ->   MoE(x, logits, w_gate, w_up, w_down, b.., sb, threshold)
    view = MoENode.of(node)
    if view.threshold is None:
        view.threshold = threshold_input(model, default_threshold)
    view.write_inputs(node)  # also moves an earlier layout's threshold (input 5) to its slot
    model.opset_imports.setdefault(MOE_DOMAIN, 1)


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """What the cost model knows of a block: experts, top-k, hidden, ffn, tokens per run, weight bytes."""

    experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens: int = 1
    itemsize: int = 4

    @classmethod
    def of(cls, node: ir.Node) -> BlockShape:
        gate = node.inputs[2].const_value  # [E, F, H]
        experts, ffn, hidden = (int(d) for d in gate.shape)
        top_k = node.attributes.get("top_k")
        dim = node.inputs[0].shape[0] if node.inputs[0].shape is not None and len(node.inputs[0].shape) else None
        # A dynamic token count is priced as decode (1 token): the case the skipping is for.
        tokens = dim if isinstance(dim, int) and dim > 0 else 1
        return cls(experts, 1 if top_k is None else int(top_k.value), hidden, ffn, tokens, gate.dtype.itemsize)

    @property
    def used_experts(self) -> float:
        """Expected experts with at least one token (uniform routing)."""
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** self.tokens)

    @property
    def bytes_used(self) -> float:
        return self.used_experts * 3 * self.hidden * self.ffn * self.itemsize

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.top_k * 3 * self.hidden * self.ffn


# Cost model  t = max(a · bytes / BW, flops / P) + c · E  (ms), fitted to bench/moe.py p50s (ORT 1.32 CPU, fp32,
# 1 thread), issue 11 and passes/lower_moe.py's AUTO_CHOICE table:
#   E64 k8 H1024 F512 1 token: if 3.1, ort-moe 3.3 ms; E128 k8 H512 F256 1 token: if 1.87, ort-moe 1.23 ms
#   (bound 1.9 / 0.48 ms: BW = 26 GB/s, a numpy copy's read + write); E8 k2 H1024 F4096 64 tokens: 37.4 / 50.8 ms.
# a: bytes streamed per bound byte; c: per-expert cost of the lowering whether it runs (If: ~20 small nodes and a
# subgraph call per expert; ort-moe: its per-expert routing loop); P: achieved GEMM rate.
_BW = 26e9
MANY_EXPERTS = 32
ORT_MOE_MARGIN = 0.85
_COST = {
    "if": {"a": 1.305, "c": 9.7e-3, "p": 86e9},
    "ort-moe": {"a": 1.62, "c": 3.5e-3, "p": 63e9},
}


def estimate_ms(lowering: str, shape: BlockShape) -> float:
    """Estimated ms of one block run with ``lowering`` (``if`` or ``ort-moe``)."""
    k = _COST[lowering]
    memory = k["a"] * shape.bytes_used / _BW * 1e3
    compute = shape.flops / k["p"] * 1e3
    return max(memory, compute) + k["c"] * shape.experts


def choose_auto(node: ir.Node, ort_moe_why_not: str | None, native_present: bool) -> str:
    """``auto``'s choice for one block: native, else the cheaper of ``if`` / ``ort-moe`` (when it can run)."""
    if native_present and native_supports(node) is None:
        return "native"
    if ort_moe_why_not is not None:
        return "if"
    return choose_by_cost(BlockShape.of(node))


def choose_by_cost(shape: BlockShape) -> str:
    """``if`` or ``ort-moe`` for a block both can run, by ``estimate_ms`` (``bench/moe.py`` prints this choice
    beside the measured times)."""
    if shape.experts < MANY_EXPERTS:
        # Measured at E8 (lower_moe.AUTO_CHOICE): If wins or is within 15 %, and only If follows the run-time
        # threshold input and ONNX TopK's tie order; the model was fitted on many experts.
        return "if"
    costs = {name: estimate_ms(name, shape) for name in ("if", "ort-moe")}
    # ort-moe only on a clear win (it ignores the run-time threshold).
    choice = "ort-moe" if costs["ort-moe"] < ORT_MOE_MARGIN * costs["if"] else "if"
    logger.debug("auto MoE lowering %s: %s (%s)", shape, choice, ", ".join(f"{k} {v:.3f} ms" for k, v in costs.items()))
    return choice


def choose_lowering(
    requested: str, node: ir.Node | None, ort_moe_why_not: str | None, native_present: bool = False
) -> str:
    """The hook of ``lower_moe.choose_lowering`` for ``native`` and ``auto``; a block the library cannot run
    falls back to ``auto``'s choice without it (warned)."""
    if requested == "native":
        why_not = "no node" if node is None else native_supports(node)
        if why_not is None:
            return "native"
        logger.warning("liblayerzero_ort.so cannot run this MoE block (%s): lowering it without it", why_not)
        return "if" if node is None else choose_auto(node, ort_moe_why_not, native_present=False)
    return choose_auto(node, ort_moe_why_not, native_present=native_present)
