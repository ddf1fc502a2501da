"""Recognise mixture-of-experts blocks in the shapes real exports take.

A candidate is a router: ``TopK(Softmax(logits) | Sigmoid(logits), k)``. From it the matcher finds the
node that combines the experts' outputs and walks back from there, checking every node, attribute, constant
and weight shape, and that the experts read the router's own top-k indices and weights:

1. ``batched_mm`` (Hugging Face ``_experts_implementation="batched_mm"``): tokens repeated k times, the
   top-k indices flattened, ``GatherND`` of the stacked ``[E, out, in]`` weights, ``MatMul`` with the
   tokens as ``[T·k, in, 1]``, ``Squeeze``; gate and up fused and split (``Split`` or ``Slice``, either
   order, concatenated or interleaved rows); scaled by the flattened routing weights,
   ``Reshape [-1, k, H]`` and ``ReduceSum`` over the k slots.
2. ``dense``: every expert on every token with stacked ``[E, in, out]`` weights (``MatMul`` of ``[T, H]``
   by ``[E, H, F]``), combined with a ``[T, E]`` routing matrix by ``Einsum("te,eth->th")`` or
   ``ReduceSum(Unsqueeze(Transpose(R)) * Y, axis 0)``.
3. ``unrolled``: one FFN per expert (``MatMul`` / ``Gemm``), each scaled by its column of the routing
   matrix (``Slice`` or ``Gather``) and summed (``Add`` chain or ``Sum``).

The routing matrix (2, 3) is ``ScatterElements(zeros, indices, weights, axis=1)`` or
``ReduceSum(OneHot(indices, E) * weights[..., None], axis 1)``. Routing weights are the top-k probabilities,
or those divided by their sum (``normalize``). Activations: silu (``x * Sigmoid(x)``), relu, gelu (the
``Gelu`` op or its erf form). Anything else is not a match, and the reason says which check failed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import common_scope, const_array, same_shape, scope_of

__all__ = ["MoEMatch", "NoMatch", "Rejection", "Router", "find_moe_blocks", "match_router"]

_STD = ("", "ai.onnx")


class NoMatch(Exception):
    """A check of the matcher failed; the message says which."""


@dataclasses.dataclass
class Router:
    topk: ir.Node
    scores: ir.Node  # Softmax | Sigmoid
    logits: ir.Value  # [T, E]
    values: ir.Value  # TopK values
    indices: ir.Value  # TopK indices
    top_k: int
    experts: int
    scoring: str  # "softmax" | "sigmoid"


@dataclasses.dataclass
class MoEMatch:
    path: str
    form: str  # "batched_mm" | "dense" | "unrolled"
    router: Router
    hidden: ir.Value  # [T, H]
    output: ir.Value  # [T, H]: what the block's consumers read
    normalize: int
    activation: str
    w_gate: np.ndarray  # [E, F, H]
    w_up: np.ndarray  # [E, F, H]
    w_down: np.ndarray  # [E, H, F]
    nodes: list[ir.Node]  # the experts' nodes (router excluded), dead once ``output`` is replaced

    @property
    def experts(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def params_per_expert(self) -> list[int]:
        return [int(self.w_gate[e].size + self.w_up[e].size + self.w_down[e].size) for e in range(self.experts)]


@dataclasses.dataclass
class Rejection:
    scope: str
    reason: str


# ----------------------------------------------------------------------------------------------- helpers


def _need(condition: bool, reason: str) -> None:
    if not condition:
        raise NoMatch(reason)


def _ints(value: ir.Value | None) -> list[int] | None:
    array = const_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _dim(value: ir.Value, axis: int) -> int | None:
    if value.shape is None or not -len(value.shape) <= axis < len(value.shape):
        return None
    d = value.shape[axis]
    return d if isinstance(d, int) else None


def _axes(node: ir.Node) -> list[int] | None:
    """Reduce/Squeeze/Unsqueeze axes, from the input (opset ≥ 13/18) or the attribute."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return _ints(node.inputs[1])
    axes = _attr(node, "axes")
    return None if axes is None else [int(a) for a in axes]


def _norm(axes: list[int] | None, rank: int) -> list[int] | None:
    return None if axes is None else sorted(a + rank if a < 0 else a for a in axes)


def _commuted(node: ir.Node) -> Iterator[tuple[ir.Value, ir.Value]]:
    a, b = node.inputs[0], node.inputs[1]
    yield a, b
    yield b, a


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


class _Walk:
    """Backward matching over producers, remembering every computing node it accepts."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        # Cheap router-side nodes other blocks may share (an exporter's CSE merges equal zeros / sums).
        self.shareable: set[ir.Node] = set()
        self.deepest: tuple[int, str] = (-1, "")  # the failed attempt that matched most nodes, and why

    def node(self, value: ir.Value | None, ops: str | tuple[str, ...], what: str) -> ir.Node:
        ops = (ops,) if isinstance(ops, str) else ops
        producer = None if value is None else value.producer()
        if producer is None or producer.op_type not in ops or producer.domain not in _STD:
            found = "nothing" if value is None else ("a graph input or constant" if producer is None else "")
            if producer is not None:
                found = f"{producer.op_type} ({producer.name})"
            raise NoMatch(f"{what}: expected {' or '.join(ops)}, found {found}")
        if producer not in self.nodes:
            self.nodes.append(producer)
        return producer

    def attempt(self, fn: Callable[[], object]) -> object:
        """Run ``fn``; on NoMatch forget the nodes it accepted and re-raise."""
        mark = len(self.nodes)
        try:
            return fn()
        except NoMatch as exc:
            self.note(exc)
            del self.nodes[mark:]
            raise

    def note(self, exc: NoMatch) -> None:
        if len(self.nodes) > self.deepest[0]:
            self.deepest = (len(self.nodes), str(exc))


def _weight(value: ir.Value, rank: int, what: str) -> np.ndarray:
    array = const_array(value)
    _need(array is not None, f"{what}: {value.name} is not a constant weight")
    _need(array.ndim == rank, f"{what}: {value.name} has shape {list(array.shape)}, expected rank {rank}")
    _need(array.dtype.kind == "f", f"{what}: {value.name} has dtype {array.dtype}, expected a float type")
    return array


# ----------------------------------------------------------------------------------------------- router


def match_router(topk: ir.Node) -> Router:
    """``TopK(Softmax(logits, -1) | Sigmoid(logits), k, axis=-1, largest=1)`` with ``logits`` ``[T, E]``."""
    _need(topk.op_type == "TopK" and topk.domain in _STD, "not a TopK")
    scores_value = topk.inputs[0]
    scores = scores_value.producer() if scores_value is not None else None
    _need(
        scores is not None and scores.op_type in ("Softmax", "Sigmoid") and scores.domain in _STD,
        "router: TopK does not read Softmax or Sigmoid scores",
    )
    logits = scores.inputs[0]
    rank = _rank(logits)
    _need(rank == 2, f"router: logits {logits.name} have rank {rank}, expected [tokens, experts]")
    experts = _dim(logits, 1)
    _need(experts is not None, f"router: the number of experts (dim 1 of {logits.name}) is not static")
    if scores.op_type == "Softmax":
        _need(_attr(scores, "axis", -1) in (-1, 1), "router: Softmax is not over the experts axis")
    _need(_attr(topk, "axis", -1) in (-1, 1), "router: TopK is not over the experts axis")
    _need(_attr(topk, "largest", 1) == 1, "router: TopK takes the smallest scores (largest=0)")
    k = _ints(topk.inputs[1]) if len(topk.inputs) > 1 else None
    _need(k is not None and len(k) == 1, "router: TopK's k is not a constant")
    _need(1 <= k[0] <= experts, f"router: k={k[0]} is outside 1..{experts}")
    return Router(
        topk=topk,
        scores=scores,
        logits=logits,
        values=topk.outputs[0],
        indices=topk.outputs[1],
        top_k=k[0],
        experts=experts,
        scoring=scores.op_type.lower(),
    )


def _routing_weights(w: _Walk, value: ir.Value, router: Router) -> int:
    """``normalize`` of the routing weights ``value``: the top-k values (0), or values / their sum (1)."""
    if value is router.values:
        return 0
    div = w.node(value, "Div", "routing weights")
    _need(div.inputs[0] is router.values, "routing weights: the Div does not divide the router's top-k values")
    total = w.node(div.inputs[1], "ReduceSum", "routing weights: the divisor")
    w.shareable.update((div, total))
    _need(total.inputs[0] is router.values, "routing weights: the divisor is not the sum of the top-k values")
    _need(_norm(_axes(total), 2) == [1], "routing weights: the divisor does not sum over the top-k axis")
    _need(_attr(total, "keepdims", 1) == 1, "routing weights: the divisor's ReduceSum drops the axis")
    return 1


def _routing_matrix(w: _Walk, value: ir.Value, router: Router) -> int:
    """A ``[T, E]`` matrix holding the routing weights at the top-k experts and 0 elsewhere."""
    node = w.node(value, ("ScatterElements", "ReduceSum"), "routing matrix")
    if node.op_type == "ScatterElements":
        _need(_attr(node, "axis", 0) in (1, -1), "routing matrix: ScatterElements is not along the experts axis")
        _need(_attr(node, "reduction", "none") == "none", "routing matrix: ScatterElements reduces")
        _need(node.inputs[1] is router.indices, "routing matrix: scattered at other indices than the router's")
        _zeros_like_logits(w, node.inputs[0], router)
        return _routing_weights(w, node.inputs[2], router)
    # ReduceSum(OneHot(indices, E) * Unsqueeze(weights, -1), axis=1)
    _need(_norm(_axes(node), 3) == [1], "routing matrix: the one-hot sum is not over the top-k axis")
    _need(_attr(node, "keepdims", 1) == 0, "routing matrix: the one-hot sum keeps the top-k axis")
    mul = w.node(node.inputs[0], "Mul", "routing matrix: one-hot × weights")
    for hot_value, weights_value in _commuted(mul):
        try:
            return w.attempt(lambda h=hot_value, v=weights_value: _one_hot_times(w, h, v, router))
        except NoMatch as exc:
            reason = str(exc)
    raise NoMatch(reason)


def _zeros_like_logits(w: _Walk, value: ir.Value, router: Router) -> None:
    """``value`` is zeros of the logits' shape: ``ConstantOfShape(0)`` or ``Expand(0, shape)`` (torch's
    ``zeros``), of ``Shape(logits)`` or with the same inferred (symbolic) shape as the logits."""
    what = "routing matrix: the scattered-into tensor"
    node = w.node(value, ("ConstantOfShape", "Expand"), what)
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        zero = fill is None or not np.any(fill.value.numpy())
    else:
        fill = const_array(node.inputs[0])
        zero = fill is not None and fill.size == 1 and not np.any(fill)
    _need(zero, f"{what} is not 0")
    w.shareable.add(node)
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
    _need(same_shape(value, router.logits), f"{what} does not have the router logits' shape")


def _one_hot_times(w: _Walk, hot_value: ir.Value, weights_value: ir.Value, router: Router) -> int:
    hot = w.node(hot_value, ("OneHot", "Cast"), "routing matrix: one-hot")
    if hot.op_type == "Cast":
        hot = w.node(hot.inputs[0], "OneHot", "routing matrix: one-hot")
    _need(hot.inputs[0] is router.indices, "routing matrix: one-hot of other indices than the router's")
    _need(_attr(hot, "axis", -1) in (-1, 2), "routing matrix: one-hot axis is not last")
    depth = const_array(hot.inputs[1])
    _need(
        depth is not None and depth.size == 1 and int(depth.reshape(-1)[0]) == router.experts,
        "routing matrix: one-hot depth is not the number of experts",
    )
    values = const_array(hot.inputs[2])
    _need(values is not None and values.reshape(-1).tolist() == [0, 1], "routing matrix: one-hot values are not [0, 1]")
    unsq = w.node(weights_value, "Unsqueeze", "routing matrix: weights[..., None]")
    _need(_norm(_axes(unsq), 3) == [2], "routing matrix: weights are not unsqueezed on the last axis")
    return _routing_weights(w, unsq.inputs[0], router)


# ----------------------------------------------------------------------------------------------- activation


def _mul_factors(value: ir.Value, w: _Walk, root: bool = True) -> list[ir.Value]:
    producer = value.producer()
    if (
        producer is not None
        and producer.op_type == "Mul"
        and producer.domain in _STD
        and (root or len(value.uses()) == 1)
    ):
        if producer not in w.nodes:
            w.nodes.append(producer)
        return _mul_factors(producer.inputs[0], w, False) + _mul_factors(producer.inputs[1], w, False)
    return [value]


def _scalar(value: ir.Value) -> float | None:
    array = const_array(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def _activation(w: _Walk, value: ir.Value) -> tuple[str, ir.Value]:
    """``(name, x)`` for ``value = act(x)``: silu, relu or gelu (exact)."""
    producer = value.producer()
    _need(producer is not None and producer.domain in _STD, "activation: no producer")
    if producer.op_type == "Relu":
        w.node(value, "Relu", "activation")
        return "relu", producer.inputs[0]
    if producer.op_type == "Gelu":
        _need(_attr(producer, "approximate", "none") == "none", "activation: Gelu with the tanh approximation")
        w.node(value, "Gelu", "activation")
        return "gelu", producer.inputs[0]
    _need(producer.op_type == "Mul", f"activation: {producer.op_type} is not silu, gelu or relu")
    for x, sig in _commuted(producer):
        s = sig.producer()
        if s is not None and s.op_type == "Sigmoid" and s.domain in _STD and s.inputs[0] is x:
            w.node(value, "Mul", "activation")
            w.node(sig, "Sigmoid", "activation")
            return "silu", x
    # gelu, erf form: x · 0.5 · (1 + erf(x / √2)), in any association of the Muls.
    return w.attempt(lambda: _gelu_erf(w, value))


def _gelu_erf(w: _Walk, value: ir.Value) -> tuple[str, ir.Value]:
    factors = _mul_factors(value, w)
    _need(len(factors) == 3, "activation: a product that is not x · Sigmoid(x) nor x · 0.5 · (1 + erf(x/√2))")
    halves = [f for f in factors if _scalar(f) is not None]
    _need(len(halves) == 1 and _near(_scalar(halves[0]), 0.5), "activation: no 0.5 factor of gelu")
    rest = [f for f in factors if f is not halves[0]]
    for x, one_plus in (rest, rest[::-1]):
        add = one_plus.producer()
        if add is None or add.op_type != "Add" or add.domain not in _STD:
            continue
        for erf_value, one in _commuted(add):
            erf = erf_value.producer()
            if erf is None or erf.op_type != "Erf" or _scalar(one) is None or not _near(_scalar(one), 1.0):
                continue
            scaled = erf.inputs[0].producer()
            if scaled is None or scaled.inputs[0] is not x:
                continue
            c = _scalar(scaled.inputs[1])
            ok = c is not None and (
                (scaled.op_type == "Div" and _near(c, math.sqrt(2.0)))
                or (scaled.op_type == "Mul" and _near(c, math.sqrt(0.5)))
            )
            if ok:
                for n in (add, erf, scaled):
                    if n not in w.nodes:
                        w.nodes.append(n)
                return "gelu", x
    raise NoMatch("activation: a product that is not x · Sigmoid(x) nor x · 0.5 · (1 + erf(x/√2))")


def _act_times_up(w: _Walk, value: ir.Value) -> tuple[str, ir.Value, ir.Value]:
    """``value = act(gate) * up`` → ``(act, gate, up)``."""
    mul = w.node(value, "Mul", "expert FFN: act(gate) × up")
    reason = "expert FFN: neither factor of act(gate) × up is an activation"
    for a, up in _commuted(mul):
        try:
            act, gate = w.attempt(lambda a=a: _activation(w, a))
            return act, gate, up
        except NoMatch as exc:
            reason = f"expert FFN: {exc}"
    raise NoMatch(reason)


# ----------------------------------------------------------------------------------------------- rows


def _row_selection(w: _Walk, value: ir.Value) -> tuple[ir.Value, Callable[[int], np.ndarray] | None]:
    """``value`` = rows of a fused projection along its last axis (Split or Slice) → (source, rows(dim))."""
    producer = value.producer()
    if producer is None or producer.domain not in _STD or producer.op_type not in ("Split", "Slice"):
        return value, None
    source = producer.inputs[0]
    rank = _rank(source)
    _need(rank is not None, f"gate/up split: rank of {source.name} unknown")
    if producer.op_type == "Split":
        _need(
            _norm([int(_attr(producer, "axis", 0))], rank) == [rank - 1], "gate/up split: Split is not on the last axis"
        )
        j = list(producer.outputs).index(value)
        n = len(producer.outputs)
        sizes = _ints(producer.inputs[1]) if len(producer.inputs) > 1 and producer.inputs[1] is not None else None
        if sizes is None:
            split = _attr(producer, "split")
            sizes = None if split is None else [int(s) for s in split]

        def rows(dim: int, sizes=sizes) -> np.ndarray:
            if sizes is None:  # equal parts; ONNX makes the last one smaller when dim % n != 0
                part = -(-dim // n)
                bounds = [min(i * part, dim) for i in range(n + 1)]
            else:
                _need(sum(sizes) == dim, "gate/up split: split sizes do not add up to the projection width")
                bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            return np.arange(bounds[j], bounds[j + 1])

        w.node(value, "Split", "gate/up split")
        return source, rows
    starts, ends = _ints(producer.inputs[1]), _ints(producer.inputs[2])
    axes = _ints(producer.inputs[3]) if len(producer.inputs) > 3 and producer.inputs[3] is not None else None
    steps = _ints(producer.inputs[4]) if len(producer.inputs) > 4 and producer.inputs[4] is not None else None
    _need(starts is not None and ends is not None and len(starts) == 1, "gate/up split: Slice bounds are not constants")
    _need(axes is not None and _norm(axes, rank) == [rank - 1], "gate/up split: Slice is not on the last axis")
    step = 1 if steps is None else steps[0]

    def rows(dim: int) -> np.ndarray:
        return np.arange(dim)[slice(starts[0], ends[0], step)]

    w.node(value, "Slice", "gate/up split")
    return source, rows


def _gate_up(
    w: _Walk, gate: ir.Value, up: ir.Value, projection: Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]
) -> tuple[np.ndarray, np.ndarray, ir.Value]:
    """Gate and up weights ``[E, F, H]`` (stacked, ``[out, in]``), fused or not, and the input they read."""
    gate_src, gate_rows = _row_selection(w, gate)
    up_src, up_rows = _row_selection(w, up)
    if gate_rows is not None or up_rows is not None:
        _need(
            gate_src is up_src and gate_rows is not None and up_rows is not None,
            "gate/up split: gate and up are not two parts of one projection",
        )
        fused, x = projection(gate_src, "gate/up projection")
        g, u = fused[:, gate_rows(fused.shape[1]), :], fused[:, up_rows(fused.shape[1]), :]
        _need(g.shape[1] == u.shape[1] and g.shape[1] > 0, "gate/up split: gate and up have different widths")
        return g, u, x
    g, x_g = projection(gate, "gate projection")
    u, x_u = projection(up, "up projection")
    _need(x_g is x_u, "expert FFN: gate and up read different inputs")
    _need(g.shape == u.shape, "expert FFN: gate and up weights have different shapes")
    return g, u, x_g


# ----------------------------------------------------------------------------------------------- forms


def _flat_indices(w: _Walk, value: ir.Value, router: Router) -> None:
    """``Unsqueeze(Reshape(indices, [-1]), [1])``: the top-k indices as GatherND rows ``[T·k, 1]``."""
    unsq = w.node(value, "Unsqueeze", "expert index")
    _need(_norm(_axes(unsq), 2) == [1], "expert index: not unsqueezed to [T·k, 1]")
    flat = w.node(unsq.inputs[0], "Reshape", "expert index")
    _need(_ints(flat.inputs[1]) == [-1], "expert index: the top-k indices are not flattened with Reshape [-1]")
    _need(flat.inputs[0] is router.indices, "expert index: not the router's top-k indices")


def _batched_projection(w: _Walk, router: Router) -> Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]:
    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        squeeze = w.node(value, "Squeeze", what)
        _need(_norm(_axes(squeeze), 3) == [2], f"{what}: Squeeze is not of the last axis")
        matmul = w.node(squeeze.inputs[0], "MatMul", what)
        gather = w.node(matmul.inputs[0], "GatherND", f"{what}: per-token expert weights")
        _need(_attr(gather, "batch_dims", 0) == 0, f"{what}: GatherND with batch_dims")
        weight = _weight(gather.inputs[0], 3, f"{what}: expert weights")
        _need(
            weight.shape[0] == router.experts,
            f"{what}: {weight.shape[0]} experts' weights for a router of {router.experts}",
        )
        _flat_indices(w, gather.inputs[1], router)
        unsq = w.node(matmul.inputs[1], "Unsqueeze", f"{what}: tokens as [T·k, in, 1]")
        _need(_norm(_axes(unsq), 3) == [2], f"{what}: tokens are not unsqueezed to [T·k, in, 1]")
        return weight, unsq.inputs[0]

    return projection


def _repeated_tokens(w: _Walk, value: ir.Value, top_k: int, hidden_size: int) -> ir.Value:
    """``Reshape(Expand(Unsqueeze(x, 1), [1, k, 1]), [-1, H])`` (``repeat_interleave(x, k, dim=0)``) → x."""
    reshape = w.node(value, "Reshape", "repeated tokens")
    _need(_ints(reshape.inputs[1]) == [-1, hidden_size], "repeated tokens: not reshaped to [-1, H]")
    repeated = reshape.inputs[0]
    producer = repeated.producer() if repeated is not None else None
    if top_k > 1 or (producer is not None and producer.op_type == "Expand"):
        # With k = 1 the Expand to [1, 1, 1] is an identity the static passes remove first.
        expand = w.node(repeated, "Expand", "repeated tokens")
        shape = _ints(expand.inputs[1])
        _need(
            shape is not None and len(shape) == 3 and shape[1] == top_k and shape[0] == 1 and shape[2] == 1,
            f"repeated tokens: not expanded k={top_k} times (Expand to [1, k, 1])",
        )
        repeated = expand.inputs[0]
    unsq = w.node(repeated, "Unsqueeze", "repeated tokens")
    _need(_norm(_axes(unsq), 3) == [1], "repeated tokens: not unsqueezed at axis 1")
    x = unsq.inputs[0]
    _need(_rank(x) == 2, "repeated tokens: the hidden state is not [T, H]")
    return x


def _match_batched_mm(w: _Walk, end: ir.Node, router: Router) -> dict:
    # ReduceSum(Reshape(Mul(down, Unsqueeze(Reshape(weights, [-1]), 1)), [-1, k, H]), axis=1)
    _need(end.op_type == "ReduceSum", "batched_mm: the combination is not a ReduceSum")
    _need(_norm(_axes(end), 3) == [1], "batched_mm: ReduceSum is not over the top-k slots")
    _need(_attr(end, "keepdims", 1) == 0, "batched_mm: ReduceSum keeps the top-k axis")
    reshape = w.node(end.inputs[0], "Reshape", "batched_mm: [T·k, H] → [T, k, H]")
    shape = _ints(reshape.inputs[1])
    _need(
        shape is not None and len(shape) == 3 and shape[0] == -1 and shape[1] == router.top_k,
        f"batched_mm: not reshaped to [-1, k={router.top_k}, H]",
    )
    hidden_size = shape[2]
    mul = w.node(reshape.inputs[0], "Mul", "batched_mm: expert output × routing weight")
    reason, down_value = "batched_mm: no factor is the flattened routing weights", None
    for other, weight_value in _commuted(mul):
        try:
            normalize = w.attempt(lambda v=weight_value: _flat_weights(w, v, router))
        except NoMatch as exc:
            reason = str(exc)
            continue
        down_value = other
        break
    _need(down_value is not None, reason)
    projection = _batched_projection(w, router)
    w_down, h = projection(down_value, "down projection")
    _need(w_down.shape[1] == hidden_size, f"batched_mm: down weights {list(w_down.shape)} do not give H={hidden_size}")
    act, gate, up = _act_times_up(w, h)
    w_gate, w_up, xr = _gate_up(w, gate, up, projection)
    x = _repeated_tokens(w, xr, router.top_k, hidden_size)
    return {"hidden": x, "normalize": normalize, "activation": act, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}


def _flat_weights(w: _Walk, value: ir.Value, router: Router) -> int:
    unsq = w.node(value, "Unsqueeze", "routing weight per slot")
    _need(_norm(_axes(unsq), 2) == [1], "routing weight per slot: not unsqueezed to [T·k, 1]")
    flat = w.node(unsq.inputs[0], "Reshape", "routing weight per slot")
    _need(_ints(flat.inputs[1]) == [-1], "routing weight per slot: not flattened with Reshape [-1]")
    return _routing_weights(w, flat.inputs[0], router)


def _stacked_projection(w: _Walk) -> Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]:
    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        matmul = w.node(value, "MatMul", what)
        weight = _weight(matmul.inputs[1], 3, f"{what}: stacked weights [E, in, out]")
        x = matmul.inputs[0]
        _need(_rank(x) in (2, 3), f"{what}: input {x.name} is not [T, in] or [E, T, in]")
        return np.ascontiguousarray(weight.transpose(0, 2, 1)), x

    return projection


def _match_dense(w: _Walk, end: ir.Node, router: Router) -> dict:
    if end.op_type == "Einsum":
        eq = str(_attr(end, "equation", "")).replace(" ", "")
        lhs, _, out = eq.partition("->")
        terms = lhs.split(",")
        _need(len(terms) == 2 and len(out) == 2, f"dense: Einsum {eq!r} is not a [T, E] × [E, T, H] combination")
        r_i = 0 if len(terms[0]) == 2 else 1
        r, y = terms[r_i], terms[1 - r_i]
        _need(
            len(r) == 2 and len(y) == 3 and len(set(r + y[2])) == 3 and y == r[1] + r[0] + out[1] and out[0] == r[0],
            f"dense: Einsum {eq!r} is not 'te,eth->th'",
        )
        r_value, y_value = end.inputs[r_i], end.inputs[1 - r_i]
    else:
        _need(end.op_type == "ReduceSum", "dense: the combination is not an Einsum or ReduceSum")
        _need(_norm(_axes(end), 3) == [0], "dense: ReduceSum is not over the experts axis")
        _need(_attr(end, "keepdims", 1) == 0, "dense: ReduceSum keeps the experts axis")
        mul = w.node(end.inputs[0], "Mul", "dense: routing × expert outputs")
        r_value = y_value = None
        for a, b in _commuted(mul):
            unsq = a.producer()
            if unsq is None or unsq.op_type != "Unsqueeze" or _norm(_axes(unsq), 3) != [2]:
                continue
            tr = unsq.inputs[0].producer()
            if tr is None or tr.op_type != "Transpose" or list(_attr(tr, "perm", [1, 0])) != [1, 0]:
                continue
            w.nodes.extend(n for n in (unsq, tr) if n not in w.nodes)
            r_value, y_value = tr.inputs[0], b
            break
        _need(r_value is not None, "dense: no factor is the transposed routing matrix [E, T, 1]")
    normalize = _routing_matrix(w, r_value, router)
    projection = _stacked_projection(w)
    w_down, h = projection(y_value, "down projection")
    act, gate, up = _act_times_up(w, h)
    w_gate, w_up, x = _gate_up(w, gate, up, projection)
    _need(_rank(x) == 2, "dense: the experts' input is not the hidden state [T, H]")
    return {"hidden": x, "normalize": normalize, "activation": act, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}


def _linear(w: _Walk) -> Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]:
    """One expert's projection as a stacked weight of one expert ``[1, out, in]``."""

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        node = w.node(value, ("MatMul", "Gemm"), what)
        weight = _weight(node.inputs[1], 2, f"{what}: weight")
        if node.op_type == "Gemm":
            _need(len(node.inputs) < 3 or node.inputs[2] is None, f"{what}: Gemm with a bias")
            _need(_attr(node, "transA", 0) == 0 and _attr(node, "alpha", 1.0) == 1.0, f"{what}: Gemm with transA/alpha")
            if not _attr(node, "transB", 0):
                weight = weight.T
        else:
            weight = weight.T
        _need(_rank(node.inputs[0]) == 2, f"{what}: input is not [T, in]")
        return np.ascontiguousarray(weight)[None], node.inputs[0]

    return projection


def _column(w: _Walk, value: ir.Value) -> tuple[ir.Value, int]:
    """``R[:, e:e+1]`` (Slice) or ``R[:, e][:, None]`` (Gather + Unsqueeze) or ``Gather(R, [e], axis=1)``."""
    node = w.node(value, ("Slice", "Unsqueeze", "Gather"), "routing column")
    if node.op_type == "Slice":
        starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])
        axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        _need(axes is not None and _norm(axes, 2) == [1] and steps == [1], "routing column: Slice not on axis 1")
        _need(
            starts is not None
            and ends is not None
            and len(starts) == 1
            and ends[0] == starts[0] + 1
            and starts[0] >= 0,
            "routing column: Slice is not one column",
        )
        return node.inputs[0], starts[0]
    if node.op_type == "Unsqueeze":
        _need(_norm(_axes(node), 2) == [1], "routing column: not unsqueezed to [T, 1]")
        gather = w.node(node.inputs[0], "Gather", "routing column")
        index = const_array(gather.inputs[1])
        _need(index is not None and index.ndim == 0, "routing column: Gather index is not a scalar constant")
    else:
        gather = node
        index = const_array(gather.inputs[1])
        _need(index is not None and index.shape == (1,), "routing column: Gather index is not [e]")
    _need(_attr(gather, "axis", 0) in (1, -1), "routing column: Gather is not on the experts axis")
    e = int(index.reshape(-1)[0])
    _need(e >= 0, "routing column: negative expert index")
    return gather.inputs[0], e


def _sum_terms(w: _Walk, end: ir.Node) -> list[ir.Value]:
    terms: list[ir.Value] = []

    def visit(value: ir.Value) -> None:
        producer = value.producer()
        if (
            producer is not None
            and producer.op_type in ("Add", "Sum")
            and producer.domain in _STD
            and len(value.uses()) == 1
        ):
            w.nodes.append(producer)
            for v in producer.inputs:
                visit(v)
        else:
            terms.append(value)

    w.nodes.append(end)
    for v in end.inputs:
        visit(v)
    return terms


def _match_unrolled(w: _Walk, end: ir.Node, router: Router) -> dict:
    terms = _sum_terms(w, end)
    _need(len(terms) == router.experts, f"unrolled: a sum of {len(terms)} terms for {router.experts} experts")
    per_expert: dict[int, ir.Value] = {}
    matrix = None
    for term in terms:
        mul = w.node(term, "Mul", "unrolled: expert output × routing column")
        found = None
        for y, col in _commuted(mul):
            try:
                found = (w.attempt(lambda c=col: _column(w, c)), y)
                break
            except NoMatch:
                continue
        _need(found is not None, "unrolled: a term is not an expert output times a routing column")
        (r_value, e), y = found
        _need(matrix is None or r_value is matrix, "unrolled: terms read different routing matrices")
        matrix = r_value
        _need(e < router.experts and e not in per_expert, f"unrolled: expert column {e} repeated or out of range")
        per_expert[e] = y
    normalize = _routing_matrix(w, matrix, router)
    projection = _linear(w)
    gates, ups, downs, acts, x = [], [], [], set(), None
    for e in range(router.experts):
        w_down, h = projection(per_expert[e], f"expert {e} down projection")
        act, gate, up = _act_times_up(w, h)
        w_gate, w_up, x_e = _gate_up(w, gate, up, projection)
        _need(x is None or x_e is x, f"unrolled: expert {e} reads another input than expert 0")
        x = x_e
        gates.append(w_gate)
        ups.append(w_up)
        downs.append(w_down)
        acts.add(act)
    _need(len(acts) == 1, f"unrolled: experts use different activations {sorted(acts)}")
    shapes = {(g.shape, u.shape, d.shape) for g, u, d in zip(gates, ups, downs)}
    _need(len(shapes) == 1, "unrolled: experts have different weight shapes")
    return {
        "hidden": x,
        "normalize": normalize,
        "activation": acts.pop(),
        "w_gate": np.concatenate(gates),
        "w_up": np.concatenate(ups),
        "w_down": np.concatenate(downs),
    }


# ----------------------------------------------------------------------------------------------- search


def _ends(router: Router, depth: int = 12) -> list[ir.Node]:
    """Nodes downstream of the router that may combine the experts' outputs, nearest first."""
    seen: set[ir.Node] = set()
    frontier = [router.values, router.indices]
    ends: list[ir.Node] = []
    for _ in range(depth):
        nxt = []
        for value in frontier:
            for user, _ in value.uses():
                if user in seen or user.domain not in _STD:
                    continue
                seen.add(user)
                nxt.extend(user.outputs)
                if user.op_type == "ReduceSum" and router.values in user.inputs:
                    continue  # the renormalisation's sum
                if user.op_type in ("ReduceSum", "Einsum"):
                    ends.append(user)
                elif user.op_type in ("Add", "Sum"):
                    # Every Add of the chain, outermost first: the last one may be a residual connection.
                    chain = [user]
                    while True:
                        uses = chain[-1].outputs[0].uses()
                        if len(uses) != 1 or uses[0][0].op_type not in ("Add", "Sum"):
                            break
                        chain.append(uses[0][0])
                    ends.extend(n for n in reversed(chain) if n not in ends)
        frontier = nxt
    return ends


def _form_of(end: ir.Node) -> list[tuple[str, Callable[[_Walk, ir.Node, Router], dict]]]:
    if end.op_type == "Einsum":
        return [("dense", _match_dense)]
    if end.op_type == "ReduceSum":
        return [("batched_mm", _match_batched_mm), ("dense", _match_dense)]
    return [("unrolled", _match_unrolled)]


def _common_scope(nodes: list[ir.Node]) -> str:
    """The scope the nodes that have one share (nodes without a scope do not count)."""
    return common_scope([s for s in map(scope_of, nodes) if s])


def _check_block(match: MoEMatch, shareable: set[ir.Node]) -> None:
    inside = set(match.nodes)
    for node in match.nodes:
        if node in shareable:
            continue  # read elsewhere too: it stays for those readers, nothing of the experts' compute
        for out in node.outputs:
            if out is match.output:
                continue
            _need(not out.is_graph_output(), f"{out.name}, inside the experts, is a graph output")
            for user, _ in out.uses():
                _need(user in inside, f"{out.name}, inside the experts, is also read by {user.op_type} ({user.name})")
    x = match.hidden
    hidden_size = match.w_gate.shape[2]
    _need(
        match.w_down.shape == (match.experts, hidden_size, match.w_gate.shape[1]),
        f"down weights {list(match.w_down.shape)} do not fit gate weights {list(match.w_gate.shape)}",
    )
    _need(_dim(x, 1) in (None, hidden_size), f"hidden state {x.name} is not [T, {hidden_size}]")
    _need(
        x.dtype is not None and x.dtype.numpy() == match.w_gate.dtype == match.w_down.dtype,
        f"hidden state {x.name} and expert weights differ in dtype",
    )
    _need(match.router.logits.dtype == x.dtype, "router logits and hidden state differ in dtype")


def find_moe_blocks(graph: ir.Graph) -> tuple[list[MoEMatch], list[Rejection]]:
    """Every MoE block of ``graph`` (not its subgraphs) and, for each router that is no block, why."""
    matches: list[MoEMatch] = []
    rejections: list[Rejection] = []
    claimed: set[ir.Node] = set()
    for topk in [n for n in graph if n.op_type == "TopK" and n.domain in _STD]:
        scores = topk.inputs[0].producer() if topk.inputs[0] is not None else None
        if scores is None or scores.op_type not in ("Softmax", "Sigmoid"):
            continue  # not a router: no candidate
        try:
            router = match_router(topk)
        except NoMatch as exc:
            rejections.append(Rejection(_common_scope([topk]) or topk.name or "", str(exc)))
            continue
        ends = _ends(router)
        failures: list[tuple[int, str, ir.Node]] = []  # (nodes matched before failing, reason, end)
        found = None
        for end in ends:
            if end in claimed:
                continue
            for form, matcher in _form_of(end):
                w = _Walk()
                try:
                    parts = matcher(w, end, router)
                    if end not in w.nodes:
                        w.nodes.append(end)
                    block = [n for n in w.nodes if n not in (router.topk, router.scores)]
                    found = MoEMatch(
                        path=_common_scope([topk, end]),
                        form=form,
                        router=router,
                        output=end.outputs[0],
                        nodes=block,
                        **parts,
                    )
                    _check_block(found, w.shareable)
                    break
                except NoMatch as exc:
                    found = None
                    w.note(exc)
                    depth, why = w.deepest
                    reason = why if why.startswith(form) else f"{form}: {why}"
                    failures.append((depth, reason, end))
            if found is not None:
                break
        if found is None:
            scope = _common_scope([topk])
            if failures:
                # The attempt that got furthest says best why this is no block.
                _, reason, end = max(failures, key=lambda f: f[0])
                scope = _common_scope([topk, end]) or scope
            else:
                reason = (
                    "no combination of expert outputs downstream of the router (a ReduceSum over the top-k slots, "
                    "an Einsum / ReduceSum with a routing matrix, or a sum of per-expert outputs)"
                )
            rejections.append(Rejection(scope, reason))
            continue
        claimed.update(found.nodes)
        matches.append(found)
    return matches, rejections
