"""The ops ``LowerMoE`` (``passes/lower_moe.py``) builds for an ``ai.layerzero::MoE`` node: ``MoESpec`` (the
node's attributes through ``MoENode``, its expert weights as constants), the routing in standard ops, and the two
lowerings that replace the node, ``lower_if`` (an ``If`` per expert) and ``lower_ort_moe`` (``com.microsoft.MoE``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir

from layerzero.errors import UnsupportedModelError
from layerzero.passes._builder import Builder
from layerzero.passes._graph import const_array
from layerzero.passes._moe_node import MoENode

__all__ = ["NORMALIZE_EPS", "MoESpec", "expert_constant", "lower_if", "lower_ort_moe"]

# The normalisation's ``sum + 1e-20`` of ``ai.layerzero::MoE`` (plugins/reference.py NORMALIZE_EPS; a pass
# imports no plugin module).
NORMALIZE_EPS = 1e-20


@dataclasses.dataclass
class MoESpec:
    """A node to lower: its ``MoENode`` view (every attribute, read once, by MoENode: ``spec.top_k``,
    ``spec.routing``, ... are the view's) and its expert weights and biases as the constants the lowering lays
    out (biases [E, F] / [E, F] / [E, H], None: absent)."""

    view: MoENode
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    b_gate: np.ndarray | None = None
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "view":  # not set yet (copying, unpickling): no attribute of the view to give
            raise AttributeError(name)
        return getattr(self.view, name)  # the node's attributes (path, top_k, scoring, routing, score_bias, ...)

    @property
    def threshold(self) -> float:
        return self.view.zeroing_threshold

    @property
    def alpha(self) -> float:
        return self.view.activation_alpha

    @property
    def limit(self) -> float:
        return self.view.activation_limit

    @property
    def routing_v2(self) -> bool:
        """Chosen by other scores than the weights (a bias or group limits): the weights are gathered."""
        return self.view.score_bias is not None or self.view.n_group != 1

    @classmethod
    def of(cls, node: ir.Node) -> MoESpec:
        view = MoENode.of(node)
        arrays = [expert_constant(node, value, "expert weight") for value in (view.w_gate, view.w_up, view.w_down)]
        experts, ffn, hidden = arrays[0].shape
        biases = []
        for name, value, shape in (
            ("b_gate", view.b_gate, (experts, ffn)),
            ("b_up", view.b_up, (experts, ffn)),
            ("b_down", view.b_down, (experts, hidden)),
        ):
            bias = None if value is None else expert_constant(node, value, f"expert bias {name}")
            if bias is not None and bias.shape != shape:
                raise UnsupportedModelError(
                    f"MoE node {node.name}: expert bias {name} {value.name} has shape {list(bias.shape)}, "
                    f"expected {list(shape)}"
                )
            biases.append(bias)
        return cls(view, *arrays, *biases)

    @property
    def experts(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def ffn(self) -> int:
        return int(self.w_gate.shape[1])


def expert_constant(node: ir.Node, value: ir.Value | None, what: str) -> np.ndarray:
    """An expert weight / bias the lowering lays out at compile time: a constant that no feed can override."""
    array = const_array(value)
    if array is None:
        why = (
            "is an initializer that is also a graph input (a feed may override it)"
            if value is not None and value.is_graph_input()
            else "is not a constant"
        )
        raise UnsupportedModelError(
            f"MoE node {node.name}: {what} {value and value.name} {why}; the MoE lowering needs constant weights"
        )
    return array


def _activation(b: Builder, x: ir.Value, activation: str) -> ir.Value:
    if activation == "silu":
        return b.op("Mul", [x, b.op("Sigmoid", [x])])
    if activation == "relu":
        return b.op("Relu", [x])
    if activation == "gelu":
        if b.opset >= 20:
            return b.op("Gelu", [x])
        dtype = b.dtype
        half = b.const("half", np.array(0.5, dtype))
        one = b.const("one", np.array(1.0, dtype))
        root2 = b.const("sqrt2", np.array(np.sqrt(2.0), dtype))
        erf = b.op("Erf", [b.op("Div", [x, root2])])
        return b.op("Mul", [b.op("Mul", [x, half]), b.op("Add", [erf, one])])
    raise UnsupportedModelError(f"MoE block {b.scope}: activation {activation!r} is not lowered")


def _gated(b: Builder, gate: ir.Value, up: ir.Value, spec: MoESpec) -> ir.Value:
    """``glu(gate, up)`` of the node's activation (plugins/reference.py ``glu``)."""
    if spec.activation != "swiglu_oai":
        return b.op("Mul", [_activation(b, gate, spec.activation), up])
    # (Clip(up, -l, l) + 1) * g * Sigmoid(alpha * g),  g = Min(gate, l); no clamp when l is inf
    dtype = b.dtype
    if np.isfinite(spec.limit):
        gate = b.op("Clip", [gate, None, b.const("limit", np.array(spec.limit, dtype))])
        up = b.op(
            "Clip",
            [up, b.const("neg_limit", np.array(-spec.limit, dtype)), b.const("limit", np.array(spec.limit, dtype))],
        )
    glu = b.op("Mul", [gate, b.op("Sigmoid", [b.op("Mul", [gate, b.const("alpha", np.array(spec.alpha, dtype))])])])
    return b.op("Mul", [b.op("Add", [up, b.const("one", np.array(1.0, dtype))]), glu])


def _routing(
    b: Builder, logits: ir.Value, spec: MoESpec, dense: bool, threshold: ir.Value | None = None
) -> tuple[ir.Value | None, ir.Value]:
    """``(weights [T, E] or None, selected [T, E] 0/1)``, in the logits' dtype: the top-k weights and which
    experts run."""
    dtype = b.dtype
    if spec.routing == "sparsemixer":
        values, indices = _sparsemixer(b, logits, spec)
    elif spec.routing == "topk":
        values, indices = _topk(b, logits, spec)
    else:
        raise UnsupportedModelError(f"MoE block {spec.path}: routing {spec.routing!r} is not lowered")
    if spec.routed_scaling_factor != 1.0:
        values = b.op("Mul", [values, b.const("scaling", np.array(spec.routed_scaling_factor, dtype))])
    if threshold is not None:
        # At threshold 0 every weight (≥ 0) is kept, exactly; the threshold is a graph input so that the
        # runtime can raise it per request.
        if dtype != np.float32:
            threshold = b.op("Cast", [threshold], to=ir.DataType.from_numpy(dtype))
        if spec.routing_v2 or spec.routing != "topk":  # weights in the order of the choice, not their own
            top = b.reduce("ReduceMax", values, [-1], 1)
        else:  # values are sorted: the first is the token's largest weight
            top = b.op("Slice", [values, b.ints(0), b.ints(1), b.ints(1)])
        bound = b.op("Mul", [top, threshold])
        keep = b.op("Not", [b.op("Less", [values, bound])])
        values = b.op("Where", [keep, values, b.const("zero", np.array(0.0, dtype))])
        ones = b.op("Cast", [keep], to=ir.DataType.from_numpy(dtype))
    else:
        ones = b.op("ConstantOfShape", [b.op("Shape", [values])], value=ir.tensor(np.array([1.0], dtype)))
    zeros = b.op("ConstantOfShape", [b.op("Shape", [logits])], value=ir.tensor(np.array([0.0], dtype)))
    selected = b.op("ScatterElements", [zeros, indices, ones], axis=-1)
    weights = b.op("ScatterElements", [zeros, indices, values], axis=-1) if dense else None
    return weights, selected


def _topk(b: Builder, logits: ir.Value, spec: MoESpec) -> tuple[ir.Value, ir.Value]:
    """``(weights [T, k], indices [T, k])`` of top-k routing (reference steps 1-4)."""
    dtype = b.dtype
    if spec.scoring == "softmax":
        probs = b.op("Softmax", [logits], axis=-1)
    else:
        probs = b.op("Sigmoid", [logits])
    select = _selection_scores(b, probs, spec) if spec.routing_v2 else probs
    values, indices = b.op("TopK", [select, b.ints(spec.top_k)], outputs=2, axis=-1, largest=1, sorted=1)
    if spec.routing_v2:
        # Chosen by the biased / group-limited scores, weighed by the unbiased ones (moe_op_v2).
        values = b.op("GatherElements", [probs, indices], axis=-1)
    if spec.normalize:
        total = b.reduce("ReduceSum", values, [-1], 1)
        if spec.scoring == "sigmoid":
            # The reference's sum + 1e-20 (DeepSeek-V3's formula). A softmax's top-k sum is at least k / E,
            # where the 1e-20 changes no float32 (and no float16: it underflows) result, so it is left out.
            total = b.op("Add", [total, b.const("eps", np.array(NORMALIZE_EPS, dtype))])
        values = b.op("Div", [values, total])
    return values, indices


def _sparsemixer(b: Builder, logits: ir.Value, spec: MoESpec) -> tuple[ir.Value, ir.Value]:
    """PhiMoE's sparsemixer at inference, as the model computes it (reference ``_sparsemixer``): the ArgMax,
    weighed by a softmax of the logits within ``2·jitter_eps`` (relative) of the maximum; again with the first
    choice at -inf. ``(weights [T, 2], indices [T, 2])``."""
    # NOTE: the relative gaps divide by max(|s|, max); a 0 / 0 (all-zero logits) is NaN, not > eps: kept.
    dtype = b.dtype
    minus_inf = b.const("minus_inf", np.array(-np.inf, dtype))
    bound = b.const("jitter_bound", np.array(2 * spec.jitter_eps, dtype))
    magnitude = b.op("Abs", [logits])
    current, weights, choices = logits, [], []
    for step in range(2):
        top = b.reduce("ReduceMax", current, [-1], 1)
        index = b.op("ArgMax", [current], axis=-1, keepdims=1)
        gap = b.op("Div", [b.op("Sub", [top, logits]), b.op("Max", [magnitude, top])])
        masked = b.op("Where", [b.op("Greater", [gap, bound]), minus_inf, current])
        weights.append(b.op("GatherElements", [b.op("Softmax", [masked], axis=-1), index], axis=-1))
        choices.append(index)
        if step == 0:
            fill = b.op("ConstantOfShape", [b.op("Shape", [index])], value=ir.tensor(np.array([-np.inf], dtype)))
            current = b.op("ScatterElements", [logits, index, fill], axis=-1)
    return b.op("Concat", weights, axis=-1), b.op("Concat", choices, axis=-1)


def _selection_scores(b: Builder, probs: ir.Value, spec: MoESpec) -> ir.Value:
    """``probs + score_bias`` with the groups outside the ``topk_group`` best at -inf (moe_op_v2)."""
    # probs [T, E] -> s = probs + bias; groups = Reshape(s, [T, G, E/G]); score = ReduceSum(TopK(groups, 2));
    # keep = ScatterElements(0, TopK(score, topk_group).indices, 1) repeated E/G times; Where(keep, s, -inf)
    select = probs
    if spec.score_bias is not None:
        bias = spec.score_bias
        if bias.dtype is not None and bias.dtype.numpy() != b.dtype:
            bias = b.op("Cast", [bias], to=ir.DataType.from_numpy(b.dtype))
        select = b.op("Add", [probs, bias])
    if spec.n_group == 1:
        return select
    size = spec.experts // spec.n_group
    groups = b.op("Reshape", [select, b.ints(0, spec.n_group, size)])
    top2, _ = b.op("TopK", [groups, b.ints(2)], outputs=2, axis=-1, largest=1, sorted=1)
    group_scores = b.reduce("ReduceSum", top2, [-1], 0)  # [T, G]
    _, best = b.op("TopK", [group_scores, b.ints(spec.topk_group)], outputs=2, axis=-1, largest=1, sorted=1)
    zeros = b.op("ConstantOfShape", [b.op("Shape", [group_scores])], value=ir.tensor(np.array([0], np.int64)))
    ones = b.op("ConstantOfShape", [b.op("Shape", [best])], value=ir.tensor(np.array([1], np.int64)))
    kept = b.op("ScatterElements", [zeros, best, ones], axis=-1)  # [T, G] 0/1
    kept = b.op("Expand", [b.unsqueeze(kept, [-1]), b.ints(1, 1, size)])  # [T, G, E/G]
    kept = b.op("Cast", [b.op("Reshape", [kept, b.ints(0, spec.experts)])], to=ir.DataType.BOOL)
    return b.op("Where", [kept, select, b.const("minus_inf", np.array(-np.inf, b.dtype))])


def lower_if(b: Builder, node: ir.Node, spec: MoESpec, threshold: ir.Value) -> tuple[ir.Value, ir.Value]:
    # MoE(x, logits, ...)   ->   routing; acc = 0; per expert e: acc = If(any token routed to e,
    #     then: acc + ScatterND(tokens_e, w_e · down_e(act(gate_e x_e) ⊙ up_e x_e)), else: acc)
    hidden, logits = node.inputs[0], node.inputs[1]
    weights, selected = _routing(b, logits, spec, dense=True, threshold=threshold)
    mask = b.op("Cast", [selected], to=ir.DataType.BOOL)
    mask_t = b.op("Transpose", [mask], perm=[1, 0])  # [E, T]
    weights_t = b.op("Transpose", [weights], perm=[1, 0])  # [E, T]
    dtype = b.dtype
    zero = b.const("zero", np.array(0.0, dtype))
    runs = b.op("Greater", [b.reduce("ReduceSum", selected, [0], 0), zero])
    acc = b.op("ConstantOfShape", [b.op("Shape", [hidden])], value=ir.tensor(np.array([0.0], dtype)))
    ffn = spec.ffn
    for e in range(spec.experts):
        sub = b.sub(f"{spec.path}.experts.{e}")
        index = sub.const("index", np.array(e, np.int64))
        # One [H, 2F] matrix for gate and up: one MatMul reads both.
        # C order: a Fortran-ordered initializer cannot be lent to ORT without a copy (chunked verification).
        w_gate_up = sub.weight(
            "gate_up_proj", np.ascontiguousarray(np.concatenate([spec.w_gate[e].T, spec.w_up[e].T], axis=1))
        )
        w_down = sub.weight("down_proj", np.ascontiguousarray(spec.w_down[e].T))
        b_gate_up = b_down = None
        if spec.b_gate is not None or spec.b_up is not None:
            zeros = np.zeros(ffn, spec.w_gate.dtype)
            parts = [zeros if bias is None else bias[e] for bias in (spec.b_gate, spec.b_up)]
            b_gate_up = sub.weight("gate_up_bias", np.ascontiguousarray(np.concatenate(parts)))
        if spec.b_down is not None:
            b_down = sub.weight("down_bias", np.ascontiguousarray(spec.b_down[e]))
        run = sub.op("Gather", [runs, index], axis=0)
        then = sub.sub(sub.scope, body=True)
        column = then.op("Gather", [mask_t, index], axis=0)  # [T] bool
        nonzero = then.op("NonZero", [column])  # [1, n]
        tokens = then.squeeze(nonzero, [0])  # [n]
        positions = then.op("Transpose", [nonzero], perm=[1, 0])  # [n, 1]
        x = then.op("Gather", [hidden, tokens], axis=0)  # [n, H]
        fused = then.op("MatMul", [x, w_gate_up])
        if b_gate_up is not None:
            fused = then.op("Add", [fused, b_gate_up])
        gate, up = then.split(fused, [ffn, ffn], axis=-1)
        h = _gated(then, gate, up, spec)
        y = then.op("MatMul", [h, w_down])  # [n, H]
        if b_down is not None:
            y = then.op("Add", [y, b_down])
        scale = then.op("Gather", [then.op("Gather", [weights_t, index], axis=0), tokens], axis=0)
        y = then.op("Mul", [y, then.unsqueeze(scale, [1])])
        out = then.op("ScatterND", [acc, positions, y], reduction="add")
        out.dtype, out.shape = hidden.dtype, hidden.shape
        then_graph = then.graph([out], f"{sub.scope}.then")
        otherwise = sub.sub(sub.scope, body=True)
        passed = otherwise.op("Identity", [acc])
        passed.dtype, passed.shape = hidden.dtype, hidden.shape
        else_graph = otherwise.graph([passed], f"{sub.scope}.else")
        acc = sub.op("If", [run], then_branch=then_graph, else_branch=else_graph)
        acc.dtype, acc.shape = hidden.dtype, hidden.shape
    return acc, mask


def lower_ort_moe(b: Builder, node: ir.Node, spec: MoESpec) -> tuple[ir.Value, ir.Value]:
    # MoE(x, logits, w_gate, w_up, w_down)   ->   com.microsoft.MoE(x, logits, fc1 = interleave(w_gate, w_up), fc2)
    hidden, logits = node.inputs[0], node.inputs[1]
    _, selected = _routing(b, logits, spec, dense=False)
    mask = b.op("Cast", [selected], to=ir.DataType.BOOL)
    experts, ffn, size = spec.w_gate.shape
    # fc1 rows interleaved [gate_0, up_0, gate_1, up_1, ...] (swiglu_fusion=1).
    fc1 = np.empty((experts, 2 * ffn, size), dtype=spec.w_gate.dtype)
    fc1[:, 0::2] = spec.w_gate
    fc1[:, 1::2] = spec.w_up
    experts_scope = b.sub(f"{spec.path}.experts")  # the weights stay in the experts' scope
    fc1_bias = fc2_bias = None
    if spec.b_gate is not None or spec.b_up is not None:
        bias = np.zeros((experts, 2 * ffn), dtype=spec.w_gate.dtype)
        bias[:, 0::2] = 0 if spec.b_gate is None else spec.b_gate
        bias[:, 1::2] = 0 if spec.b_up is None else spec.b_up
        fc1_bias = experts_scope.weight("fc1_bias", bias)
    if spec.b_down is not None:
        fc2_bias = experts_scope.weight("fc2_bias", np.ascontiguousarray(spec.b_down))
    swiglu: dict[str, float] = {}
    if spec.activation == "swiglu_oai":
        # min(g, l) * sigmoid(alpha * min(g, l)) * (clip(u, -l, l) + beta), beta 1; no swiglu_limit: no clamp
        swiglu = {"activation_alpha": spec.alpha, "activation_beta": 1.0}
        if np.isfinite(spec.limit):
            swiglu["swiglu_limit"] = spec.limit
    y = experts_scope.op(
        "MoE",
        [
            hidden,
            logits,
            experts_scope.weight("fc1", fc1),
            fc1_bias,
            experts_scope.weight("fc2", spec.w_down),
            fc2_bias,
        ],
        domain="com.microsoft",
        k=spec.top_k,
        activation_type="swiglu",
        swiglu_fusion=1,
        normalize_routing_weights=int(spec.normalize),
        **swiglu,
    )
    y.dtype, y.shape = hidden.dtype, hidden.shape
    return y, mask
