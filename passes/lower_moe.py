"""Lower the skipping form ``ai.layerzero::MoE`` to ops ONNX Runtime runs, keeping the skipping."""

from __future__ import annotations

import dataclasses
import logging

import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.passes import lower_moe_native
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._dynamic import (
    MOE_DOMAIN,
    DynamicPath,
    read_dynamic_paths,
    record_dynamic_path,
    threshold_input,
)
from layerzero.passes._graph import NameFactory, replace_value
from layerzero.passes._moe_lowering import NORMALIZE_EPS, MoESpec, lower_if, lower_ort_moe
from layerzero.passes._moe_node import MoENode, is_moe_node

__all__ = [
    "AUTO_CHOICE",
    "LOWERINGS",
    "NORMALIZE_EPS",
    "ORT_MOE_ACTIVATIONS",
    "LowerMoE",
    "choose_lowering",
    "ort_moe_routing_supports",
    "ort_moe_supports",
]

logger = logging.getLogger(__name__)

LOWERINGS = ("auto", "if", "ort-moe", "native")


# Gated units com.microsoft.MoE computes exactly (activation_type "swiglu", fc1 rows interleaved): silu(gate) * up
# (alpha 1, beta 0, no limit), and GPT-OSS's swiglu_oai: min(gate, l) * sigmoid(alpha * min(gate, l)) *
# (clip(up, -l, l) + 1) (activation_alpha, activation_beta 1, swiglu_limit l); fc1 / fc2 biases are its inputs 3 / 5.
ORT_MOE_ACTIVATIONS = ("silu", "swiglu_oai")


def ort_moe_supports(scoring: str, activation: str, zeroing_threshold: float) -> str | None:
    """Why ``com.microsoft.MoE`` cannot compute this block (None when it can)."""
    if scoring != "softmax":
        return f"scoring {scoring!r} (com.microsoft.MoE applies softmax to the logits)"
    if activation not in ORT_MOE_ACTIVATIONS:
        return (
            f"activation {activation!r} (com.microsoft.MoE's swiglu computes silu(gate) * up and GPT-OSS's "
            "swiglu_oai only)"
        )
    if zeroing_threshold > 0:
        return f"zeroing_threshold {zeroing_threshold:g} (com.microsoft.MoE runs all top-k experts)"
    return None


def ort_moe_routing_supports(node: ir.Node) -> str | None:
    """Why ``com.microsoft.MoE`` cannot route like this node's v2 routing (moe_op_v2; None when it can): it
    chooses the top-k of the logits' softmax, with no selection bias, no group limits and no scaling."""
    if MoENode.of(node).score_bias is not None:
        return "score_bias (com.microsoft.MoE chooses by the softmax of the logits, without a selection bias)"
    view = MoENode.of(node)
    if view.n_group != 1:
        return f"n_group {view.n_group} (com.microsoft.MoE has no group-limited top-k)"
    if view.routed_scaling_factor != 1.0:
        return f"routed_scaling_factor {view.routed_scaling_factor:g} (com.microsoft.MoE does not scale the weights)"
    if view.routing != "topk":
        return f"routing {view.routing!r} (only top-k routing is lowered to com.microsoft.MoE)"
    return None


def choose_lowering(
    requested: str,
    scoring: str,
    activation: str,
    zeroing_threshold: float,
    node: ir.Node | None = None,
    native_present: bool = False,
) -> str:
    """``"if"``, ``"ort-moe"`` or ``"native"`` for one block; ``auto`` with the node: ``lower_moe_native.choose_auto``
    (native when liblayerzero_ort.so is built, else a cost model), without it ``AUTO_CHOICE``."""
    if requested not in LOWERINGS:
        raise InvalidInputError(f"moe_lowering={requested!r}; expected one of {LOWERINGS}")
    why_not = ort_moe_supports(scoring, activation, zeroing_threshold)
    if why_not is None and node is not None:
        why_not = ort_moe_routing_supports(node)
    if requested == "native" or (requested == "auto" and node is not None):
        return lower_moe_native.choose_lowering(requested, node, why_not, native_present)
    if requested == "ort-moe":
        if why_not is not None:
            logger.warning("com.microsoft.MoE cannot run this block (%s): lowering it with If subgraphs", why_not)
            return "if"
        return "ort-moe"
    if requested == "if":
        return "if"
    return AUTO_CHOICE if why_not is None else "if"


# "auto" = "if", by measurement: bench/moe.py, ORT 1.32 CPU, fp32, E=8, k=2, 1 intra-op thread on 2 shared cores,
# p50 (interleaved rounds) of the If lowering / the com.microsoft.MoE lowering / the MoE op alone:
#   H=1024 F=4096,  1 token :  3.55 /  4.24 /  3.96 ms   (dense 15.4 ms; memory bound 3.23 ms)
#   H=1024 F=4096, 64 tokens: 37.4  / 50.8  / 49.2  ms   (dense 103 ms)
#   H=256  F=1024,  1 token :  0.46 /  0.40 /  0.42 ms   (150 rounds, twice)
#   H=256  F=1024, 64 tokens:  2.7  /  4.0  /  4.0  ms
# "if" wins everywhere but a small block at 1 token, where its ~40 small routing/If nodes cost ~15 %; it also
# runs every scoring, activation and threshold (the run-time threshold input too) and keeps ONNX TopK's order
# on exact ties, which com.microsoft.MoE does not.
AUTO_CHOICE = "if"


class LowerMoE(ir.passes.InPlacePass):
    """Replace each ``ai.layerzero::MoE`` node by standard / ``com.microsoft`` ops for ONNX Runtime.

    Cases:
    1. ``if``: routing in standard ops (scores, TopK, renormalisation, threshold, ``ScatterElements`` into a
       ``[T, E]`` weight matrix and mask); per expert an ``If`` on "some token is routed to it" whose then-branch
       gathers its tokens only (``NonZero`` / ``Gather``), runs the FFN, scales by the routing weight and adds
       into the accumulator with ``ScatterND(reduction="add")``; the else-branch passes the accumulator on.
       Every scoring, activation (``swiglu_oai`` too), expert bias and threshold, and the v2 routing (selection
       bias, group-limited top-k, routed scaling, PhiMoE's sparsemixer; ``ort_moe_routing_supports`` /
       ``native_supports`` refuse it).
    2. ``ort-moe``: ``com.microsoft.MoE`` (fc1 rows interleaved gate/up, ``swiglu_fusion=1``; expert biases as
       its fc1 / fc2 biases), for softmax scoring, silu or swiglu_oai and threshold 0; the mask is computed by
       the same standard routing ops.
       NOTE: the op breaks exact ties of routing probabilities towards the higher expert index (ONNX TopK,
       the reference and ``if``: the lower), so on exactly equal logits its output differs; it also ignores
       the run-time threshold input.
    3. ``native``: the node stays for ``liblayerzero_ort.so`` (``lower_moe_native``).
    ``auto`` chooses native when the library is built, else by a cost model (``lower_moe_native.choose_auto``);
    a block ``ort-moe`` / ``native`` cannot run falls back (``if``).
    The node's mask output keeps its graph output name (``layerzero::mask::<path>``). Only the
    ``onnxruntime`` target is lowered; other targets keep the node (a TensorRT plugin implements it).
    """

    def __init__(self, lowering: str = "auto", *, enabled: bool = True, native_present: bool = False) -> None:
        """``lowering``: one of ``LOWERINGS`` (``CompileOptions.moe_lowering``). ``enabled``: False keeps the nodes
        (a target whose backend implements the op)."""
        super().__init__()
        self.requested = lowering
        if self.requested not in LOWERINGS:
            raise InvalidInputError(f"moe_lowering={self.requested!r}; expected one of {LOWERINGS}")
        self.enabled = bool(enabled)
        self.native_present = native_present  # liblayerzero_ort.so is built (the target looks; a pass cannot)
        self.lowered: list[tuple[str, str]] = []  # (path, lowering)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.lowered = []
        if not self.enabled:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        nodes = [n for n in graph if is_moe_node(n)]
        if not nodes:
            return ir.passes.PassResult(model, modified=False)
        names = NameFactory(graph)
        opset = model_opset(model)
        for node in nodes:
            view = MoENode.of(node)
            lowering = choose_lowering(
                self.requested, view.scoring, view.activation, view.zeroing_threshold, node, self.native_present
            )
            if lowering == "native":  # the node stays, for liblayerzero_ort.so: no expert weight is read
                lower_moe_native.lower_native(model, node, view.zeroing_threshold)
                self.lowered.append((view.path, lowering))
                _note_lowering(model, view.path, lowering)
                continue
            # The other lowerings lay the experts out as constants: read here (a lazy expert stack, e.g. bf16
            # upcast per expert, is materialised only for them: 1.6 GB a block at OLMoE-1B-7B's shape).
            spec = MoESpec.of(node)
            dtype = node.inputs[0].dtype.numpy() if node.inputs[0].dtype is not None else spec.w_gate.dtype
            b = Builder(graph, names, opset, scope_metadata=True, dtype=dtype).sub(spec.path)
            if lowering == "ort-moe":
                y, mask = lower_ort_moe(b, node, spec)
                model.opset_imports.setdefault("com.microsoft", 1)
            else:
                threshold = threshold_input(model, spec.threshold)
                y, mask = lower_if(b, node, spec, threshold)
            graph.insert_before(node, b.nodes)
            replace_value(node.outputs[0], y, names)
            replace_value(node.outputs[1], mask, names)
            graph.remove(node, safe=True)
            self.lowered.append((spec.path, lowering))
            _note_lowering(model, spec.path, lowering)
            logger.info("MoE block at %s lowered with %s", spec.path, lowering)
        if not any(n.domain == MOE_DOMAIN for n in graph):
            model.opset_imports.pop(MOE_DOMAIN, None)
        return ir.passes.PassResult(model, modified=True)


def _note_lowering(model: ir.Model, path: str, lowering: str) -> None:
    for entry in read_dynamic_paths(model):
        if entry.path == path:
            detail = dict(entry.detail, lowering=lowering)
            record_dynamic_path(model, DynamicPath(**{**dataclasses.asdict(entry), "detail": detail}))
