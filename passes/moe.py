"""Router-driven expert skipping: rewrite mixture-of-experts blocks into the skipping form ``ai.layerzero::MoE``."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.passes._builder import Builder
from layerzero.passes._dynamic import MASK_PREFIX, MOE_DOMAIN, MOE_OP, ROUTER_PREFIX, DynamicPath, record_dynamic_path
from layerzero.passes._graph import NAME_SCOPES_KEY, NameFactory, make_constant, replace_value
from layerzero.passes._moe import MoEMatch, Refusal, find_moe_blocks
from layerzero.passes._moe.lazy import ExpertStack, ExpertTensor
from layerzero.passes._moe.qmoe import rewrite_qmoe
from layerzero.passes._moe_node import MoENode

__all__ = ["MOE_DOMAIN", "MOE_OP", "SkipExperts"]

logger = logging.getLogger(__name__)

# ScatterND(reduction="add") of the ONNX Runtime lowering needs opset 16.
_MIN_OPSET = 16
# The v2 routing attributes (recorded in the path's detail too, where the node has them).
_ROUTING_ATTRIBUTES = frozenset({"n_group", "topk_group", "routed_scaling_factor", "routing", "jitter_eps"})


class SkipExperts(ir.passes.InPlacePass):
    """Rewrite each mixture-of-experts block into one ``ai.layerzero::MoE`` node, the skipping form.

    ``y, mask = MoE(hidden [T, H], router_logits [T, E], w_gate [E, F, H], w_up [E, F, H], w_down [E, H, F]
    [, b_gate [E, F], b_up [E, F], b_down [E, H]])`` with attributes ``top_k``, ``normalize``, ``scoring``,
    ``activation``, ``zeroing_threshold`` and ``path`` (and ``activation_alpha`` / ``activation_limit`` for
    ``swiglu_oai``); semantics in ``layerzero.plugins.reference``. Only the experts a token is routed to run for it.

    Cases (the block shapes of ``passes/_moe``; routers ``TopK(Softmax | Sigmoid(logits))`` or
    ``Softmax(TopK(logits).values)``, the latter as ``scoring="softmax", normalize=1``; routers choosing by
    biased, group-limited scores (DeepSeek-V3, GLM4-MoE, dots1, Ernie-4.5-MoE) with the v2 input ``score_bias``
    and attributes ``n_group``, ``topk_group``, ``routed_scaling_factor``, emitted only where not default; PhiMoE's
    sparsemixer (``ArgMax`` + masked softmax, twice) as ``routing="sparsemixer"`` with its ``jitter_eps``):
    1. Hugging Face ``batched_mm`` exports (Mixtral, Qwen2-MoE, GraniteMoE, ...; shared experts stay as they
       are), by ``torch.onnx`` with ``dynamo=True`` (``GatherND``) or TorchScript (``Gather``, ``Tile``,
       ``Flatten``, shapes computed from ``Shape``).
    2. Dense blocks: every expert on every token, combined with a ``[T, E]`` routing matrix.
    3. Unrolled blocks: one FFN per expert scaled by its routing column and summed.
    4. Sorted blocks (JetMoE, dynamo): the slots sorted by expert, split by the experts' token counts, one
       projection per expert, added back into the tokens' rows (``ScatterND`` add).
    5. ``com.microsoft::QMoE`` nodes: quantized or dequantized experts, or left with a refusal (``_moe/qmoe.py``).
    Expert variants (``passes/_moe/experts.py``): biases (inputs 5-7, only when the block has them), GPT-OSS's
    clamped SwiGLU (``activation="swiglu_oai"``), fused gate/up concatenated or interleaved (de-interleaved here).
    A block is rewritten only on an exact match (structure, attributes, constants, weight shapes, no
    intermediate read outside the block); every other router is listed in ``rejected`` with the reason.

    Only the main graph is searched: a block inside an ``If`` / ``Loop`` body is left alone.

    Per block the pass adds the graph outputs ``layerzero::mask::<path>`` (``[T, E]`` bool, the node's mask)
    and ``layerzero::router::<path>`` (``[T]``, each token's top-1 probability) and records a ``DynamicPath``
    with one subpath ``<path>.experts.<e>`` per expert and its parameter count. The replaced nodes are
    removed, so a second run finds nothing.
    """

    def __init__(self, zeroing_threshold: float = 0.0, quantized_experts: bool | None = None) -> None:
        """``zeroing_threshold`` (``CompileOptions.zeroing_threshold``) goes into each node. ``quantized_experts``:
        whether the lowering that follows runs quantized experts (a QMoE node quantizing its activations becomes
        such experts only then; the pipeline says, knowing the target, the lowering and the library); None: this
        build's native lowering decides (``_moe/qmoe.py``)."""
        super().__init__()
        if not (math.isfinite(zeroing_threshold) and zeroing_threshold >= 0):
            raise InvalidInputError(f"zeroing_threshold={zeroing_threshold!r}; expected a finite number >= 0")
        self.zeroing_threshold = float(zeroing_threshold)
        self.quantized_experts = quantized_experts
        self.rewritten: list[tuple[str, str]] = []  # (path, form)
        self.rejected: list[Refusal] = []  # kind "moe": path (the block's scope), reason, node

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        matches, self.rejected = find_moe_blocks(graph)
        self.rewritten = []
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if matches and opset < _MIN_OPSET:
            for m in matches:
                reason = f"model opset {opset} < {_MIN_OPSET} (convert the model first)"
                self.rejected.append(Refusal(m.path, reason, kind="moe"))
            matches = []
        names = NameFactory(graph)
        used_paths: set[str] = set()
        # Blocks are matched before any is rewritten. A block may read what an earlier one wrote (stacked
        # blocks without a residual: block 1's hidden state is block 0's output), and rewriting block 0 makes
        # every node read its new output instead; the later matches must follow, or the MoE node built for
        # block 1 reads the removed value.
        rewired: dict[ir.Value, ir.Value] = {}
        for i, match in enumerate(matches):
            match.hidden = _follow(rewired, match.hidden)
            match.router.logits = _follow(rewired, match.router.logits)
            path = match.path or f"moe_{i}"
            while path in used_paths:
                path = f"{path}_{i}"
            used_paths.add(path)
            rewired[match.output] = self._rewrite(model, match, path, names, opset)
            self.rewritten.append((path, match.form))
            logger.info(
                "MoE block at %s (%s, %d experts, top-%d): skipping form",
                path,
                match.form,
                match.experts,
                match.router.top_k,
            )
        for r in self.rejected:
            logger.info(
                "MoE candidate at %s: not rewritten (at node %s): %s", r.path or "(no scope)", r.node or "?", r.reason
            )
        quantized = rewrite_qmoe(model, names, self.zeroing_threshold, used_paths, self.rewritten, self.rejected,
                                 self.quantized_experts)  # fmt: skip
        if matches or quantized:
            model.opset_imports[MOE_DOMAIN] = 1
        return ir.passes.PassResult(model, modified=bool(matches) or quantized)

    def _rewrite(self, model: ir.Model, m: MoEMatch, path: str, names: NameFactory, opset: int) -> ir.Value:
        """Replace the block by the skipping form; return the value that now stands for ``m.output``."""
        # router(x) → TopK → experts(x) → combine   ->   y, mask = MoE(x, logits, w_gate, w_up, w_down)
        # NOTE: the router's logits stay as exported (any Gemm/MatMul/bias); only scores onward are replaced.
        graph = model.graph
        router = m.router
        end = m.output.producer()
        weights = [
            _expert_constant(graph, names, f"{path}.experts.{part}", array)
            for part, array in (("w_gate", m.w_gate), ("w_up", m.w_up), ("w_down", m.w_down))
        ]
        b_gate, b_up, b_down = _expert_biases(graph, names, path, m)
        score_bias = None
        if router.score_bias is not None:
            score_bias = make_constant(graph, names, f"{path}.router.score_bias", router.score_bias)
        hidden, scoring, before = m.hidden, router.scoring, []
        if m.input_scale:
            # Llama 4 (top-1): the expert reads x · sigmoid(top logit); its weight is then 1, the top-1 softmax
            # probability normalised over itself (p / (p + 1e-20) == 1 for p >= 1 / E).
            scaler = Builder(graph, names, opset, node_prefix=f"/{path}/input_scale/",
                             value_prefix=f"{path}.input_scale.")  # fmt: skip
            hidden = _scaled_hidden(scaler, m.hidden, router.logits)
            before, scoring = scaler.nodes, "softmax"
        view = MoENode(
            hidden,
            router.logits,
            *weights,
            b_gate=b_gate,
            b_up=b_up,
            b_down=b_down,
            score_bias=score_bias,
            top_k=router.top_k,
            normalize=bool(m.normalize),
            scoring=scoring,
            activation=m.activation,
            zeroing_threshold=self.zeroing_threshold,
            path=path,
            activation_alpha=m.activation_alpha,
            activation_limit=m.activation_limit,
            n_group=router.n_group,
            topk_group=router.topk_group,
            routed_scaling_factor=router.routed_scaling_factor,
            routing=router.routing,
            jitter_eps=router.jitter_eps,
        )
        routing_attributes = [a for a in view.attributes() if a.name in _ROUTING_ATTRIBUTES]
        node = view.to_node(
            name=names(f"/{path}/experts/MoE"), metadata_props={NAME_SCOPES_KEY: repr([path, f"{path}.experts", "moe"])}
        )
        y, mask = node.outputs
        y.name = names(f"{path}.moe_output")
        y.dtype, y.shape = m.hidden.dtype, m.hidden.shape
        mask.name = names(MASK_PREFIX + path)
        mask.dtype = ir.DataType.BOOL
        tokens = m.hidden.shape[0] if m.hidden.shape is not None else None
        mask.shape = ir.Shape([tokens, m.experts]) if tokens is not None else None
        # The top-1 probability of each token: the router's confidence (routing_confidence).
        build = Builder(graph, names, opset, node_prefix=f"/{path}/router/", value_prefix=f"{path}.router.")
        axis = {"axis": -1} if router.scores.op_type == "Softmax" else {}
        scores = build.op1(router.scores.op_type, [router.logits], **axis)
        confidence = build.reduce("ReduceMax", scores, [-1], 0)
        confidence.name = names(ROUTER_PREFIX + path)
        confidence.dtype = router.logits.dtype
        confidence.shape = ir.Shape([tokens]) if tokens is not None else None
        graph.insert_after(end, [*before, node, *build.nodes])
        replace_value(m.output, y, names)
        graph.outputs.extend([mask, confidence])
        _remove_dead(graph, [*m.nodes, end, router.topk, router.scores, *router.nodes])
        record_dynamic_path(
            model,
            DynamicPath(
                path=path,
                kind="moe",
                subpaths=tuple(f"{path}.experts.{e}" for e in range(m.experts)),
                params=tuple(m.params_per_expert),
                mask_output=mask.name,
                router_output=confidence.name,
                detail={
                    "form": m.form,
                    "experts": m.experts,
                    "top_k": router.top_k,
                    "normalize": m.normalize,
                    "scoring": scoring,
                    **({"input_scale": "sigmoid(top-1 logit)"} if m.input_scale else {}),
                    "activation": m.activation,
                    **({"expert_biases": True} if _has_biases(m) else {}),
                    "hidden": int(m.w_gate.shape[2]),
                    "ffn": int(m.w_gate.shape[1]),
                    "zeroing_threshold": self.zeroing_threshold,
                    **{a.name: a.value for a in routing_attributes},
                    **({"score_bias": True} if router.score_bias is not None else {}),
                },
            ),
        )
        return y


def _scaled_hidden(build: Builder, hidden: ir.Value, logits: ir.Value) -> ir.Value:
    """``hidden · Sigmoid(ReduceMax(logits, -1, keepdims))``: each token scaled by the sigmoid of its top logit
    (Llama 4's top-1 weighting of the expert's input), built on ``build``."""
    top = build.reduce("ReduceMax", logits, [-1], 1)
    weight = build.op1("Sigmoid", [top])
    scaled = build.op1("Mul", [hidden, weight])
    for value in (top, weight, scaled):
        value.dtype = hidden.dtype
    scaled.shape = hidden.shape
    return scaled


def _has_biases(m: MoEMatch) -> bool:
    return any(b is not None for b in (m.b_gate, m.b_up, m.b_down))


def _expert_biases(
    graph: ir.Graph, names: NameFactory, path: str, m: MoEMatch
) -> tuple[ir.Value | None, ir.Value | None, ir.Value | None]:
    """``b_gate``, ``b_up``, ``b_down`` of the node (None = absent)."""
    return tuple(  # type: ignore[return-value]
        None if array is None else make_constant(graph, names, f"{path}.experts.{part}", array)
        for part, array in (("b_gate", m.b_gate), ("b_up", m.b_up), ("b_down", m.b_down))
    )


def _expert_constant(graph: ir.Graph, names: NameFactory, hint: str, array: np.ndarray | ExpertStack) -> ir.Value:
    """The node's stacked expert weight: an initializer over the ``ExpertStack`` (read one expert at a time, never
    held whole: ``passes/_moe/lazy.py``) or of the array."""
    if not isinstance(array, ExpertStack):
        return make_constant(graph, names, hint, array)
    name = names(hint)
    value = ir.Value(name=name, const_value=ExpertTensor(array, name=name))
    value.shape = ir.Shape(array.shape)
    value.dtype = value.const_value.dtype
    graph.register_initializer(value)
    return value


def _follow(rewired: dict[ir.Value, ir.Value], value: ir.Value) -> ir.Value:
    """The value that stands for ``value`` after the rewrites so far."""
    while value in rewired:
        value = rewired[value]
    return value


def _remove_dead(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove the replaced block's nodes that nothing reads any more, consumers first."""
    alive = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in list(alive):
            if node.graph is not graph:
                alive.discard(node)
                continue
            if any(out.uses() or out.is_graph_output() for out in node.outputs):
                continue
            graph.remove(node, safe=True)
            alive.discard(node)
            changed = True
