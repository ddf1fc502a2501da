"""The expert part: one FFN ``down(act(gate x) ⊙ up x)`` per expert, and its variants.

Variants:
- activation (``ACTIVATIONS``, rules as data): silu (``x * Sigmoid(x)``, either order), relu, gelu (the
  ``Gelu`` op without the tanh approximation, or its erf form ``x · 0.5 · (1 + erf(x / √2))`` in any
  association of the Muls);
- gate and up: two projections, or one fused projection split along its last axis (``Split`` or ``Slice``,
  concatenated or interleaved rows);
- projection (which block shape reads the weights): ``batched_projection`` (``GatherND`` of stacked
  ``[E, out, in]`` weights per (token, slot), batched ``MatMul``, ``Squeeze``), ``stacked_projection``
  (``MatMul`` by stacked ``[E, in, out]``), ``linear_projection`` (one expert's ``MatMul`` / ``Gemm``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._moe.router import Router
from layerzero.passes._moe.walk import (
    STD,
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    const_scalar,
    const_weight,
    near,
    need,
    rank_of,
    reshape_dims,
    sorted_axes,
    static_ints,
)

__all__ = ["Projection", "act_times_up", "batched_projection", "gate_up", "linear_projection", "stacked_projection"]

# A projection part: (value, what) -> (weights [E, out, in], the input the projection reads).
Projection = Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]


def _mul_factors(value: ir.Value, w: Walk, root: bool = True) -> list[ir.Value]:
    producer = value.producer()
    if (
        producer is not None
        and producer.op_type == "Mul"
        and producer.domain in STD
        and (root or len(value.uses()) == 1)
    ):
        if producer not in w.nodes:
            w.nodes.append(producer)
        return _mul_factors(producer.inputs[0], w, False) + _mul_factors(producer.inputs[1], w, False)
    return [value]


def _activation(w: Walk, value: ir.Value) -> tuple[str, ir.Value]:
    """``(name, x)`` for ``value = act(x)``: silu, relu or gelu (exact)."""
    producer = value.producer()
    need(producer is not None and producer.domain in STD, "activation: no producer")
    if producer.op_type == "Relu":
        w.node(value, "Relu", "activation")
        return "relu", producer.inputs[0]
    if producer.op_type == "Gelu":
        need(attr_of(producer, "approximate", "none") == "none", "activation: Gelu with the tanh approximation")
        w.node(value, "Gelu", "activation")
        return "gelu", producer.inputs[0]
    need(producer.op_type == "Mul", f"activation: {producer.op_type} is not silu, gelu or relu")
    for x, sig in commuted(producer):
        s = sig.producer()
        if s is not None and s.op_type == "Sigmoid" and s.domain in STD and s.inputs[0] is x:
            w.node(value, "Mul", "activation")
            w.node(sig, "Sigmoid", "activation")
            return "silu", x
    # gelu, erf form: x · 0.5 · (1 + erf(x / √2)), in any association of the Muls.
    return w.attempt(lambda: _gelu_erf(w, value))


def _gelu_erf(w: Walk, value: ir.Value) -> tuple[str, ir.Value]:
    factors = _mul_factors(value, w)
    need(len(factors) == 3, "activation: a product that is not x · Sigmoid(x) nor x · 0.5 · (1 + erf(x/√2))")
    halves = [f for f in factors if const_scalar(f) is not None]
    need(len(halves) == 1 and near(const_scalar(halves[0]), 0.5), "activation: no 0.5 factor of gelu")
    rest = [f for f in factors if f is not halves[0]]
    for x, one_plus in (rest, rest[::-1]):
        add = one_plus.producer()
        if add is None or add.op_type != "Add" or add.domain not in STD:
            continue
        for erf_value, one in commuted(add):
            erf = erf_value.producer()
            if erf is None or erf.op_type != "Erf" or const_scalar(one) is None or not near(const_scalar(one), 1.0):
                continue
            scaled = erf.inputs[0].producer()
            if scaled is None or scaled.inputs[0] is not x:
                continue
            c = const_scalar(scaled.inputs[1])
            ok = c is not None and (
                (scaled.op_type == "Div" and near(c, math.sqrt(2.0)))
                or (scaled.op_type == "Mul" and near(c, math.sqrt(0.5)))
            )
            if ok:
                for n in (add, erf, scaled):
                    if n not in w.nodes:
                        w.nodes.append(n)
                return "gelu", x
    raise NoMatch("activation: a product that is not x · Sigmoid(x) nor x · 0.5 · (1 + erf(x/√2))")


def act_times_up(w: Walk, value: ir.Value) -> tuple[str, ir.Value, ir.Value]:
    """``value = act(gate) * up`` → ``(act, gate, up)``."""
    mul = w.node(value, "Mul", "expert FFN: act(gate) × up")
    reason = "expert FFN: neither factor of act(gate) × up is an activation"
    for a, up in commuted(mul):
        try:
            act, gate = w.attempt(lambda a=a: _activation(w, a))
            return act, gate, up
        except NoMatch as exc:
            reason = f"expert FFN: {exc}"
    raise NoMatch(reason)


def _row_selection(w: Walk, value: ir.Value) -> tuple[ir.Value, Callable[[int], np.ndarray] | None]:
    """``value`` = rows of a fused projection along its last axis (Split or Slice) → (source, rows(dim))."""
    producer = value.producer()
    if producer is None or producer.domain not in STD or producer.op_type not in ("Split", "Slice"):
        return value, None
    source = producer.inputs[0]
    rank = rank_of(source)
    need(rank is not None, f"gate/up split: rank of {source.name} unknown")
    if producer.op_type == "Split":
        need(
            sorted_axes([int(attr_of(producer, "axis", 0))], rank) == [rank - 1],
            "gate/up split: Split is not on the last axis",
        )
        j = list(producer.outputs).index(value)
        n = len(producer.outputs)
        sizes = const_ints(producer.inputs[1]) if len(producer.inputs) > 1 and producer.inputs[1] is not None else None
        if sizes is None:
            split = attr_of(producer, "split")
            sizes = None if split is None else [int(s) for s in split]

        def rows(dim: int, sizes=sizes) -> np.ndarray:
            if sizes is None:  # equal parts; ONNX makes the last one smaller when dim % n != 0
                part = -(-dim // n)
                bounds = [min(i * part, dim) for i in range(n + 1)]
            else:
                need(sum(sizes) == dim, "gate/up split: split sizes do not add up to the projection width")
                bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            return np.arange(bounds[j], bounds[j + 1])

        w.node(value, "Split", "gate/up split")
        return source, rows
    starts, ends = static_ints(w, producer.inputs[1]), static_ints(w, producer.inputs[2])
    axes = const_ints(producer.inputs[3]) if len(producer.inputs) > 3 and producer.inputs[3] is not None else None
    steps = const_ints(producer.inputs[4]) if len(producer.inputs) > 4 and producer.inputs[4] is not None else None
    need(starts is not None and ends is not None and len(starts) == 1, "gate/up split: Slice bounds are not constants")
    need(axes is not None and sorted_axes(axes, rank) == [rank - 1], "gate/up split: Slice is not on the last axis")
    step = 1 if steps is None else steps[0]

    def rows(dim: int) -> np.ndarray:
        return np.arange(dim)[slice(starts[0], ends[0], step)]

    w.node(value, "Slice", "gate/up split")
    return source, rows


def gate_up(
    w: Walk, gate: ir.Value, up: ir.Value, projection: Callable[[ir.Value, str], tuple[np.ndarray, ir.Value]]
) -> tuple[np.ndarray, np.ndarray, ir.Value]:
    """Gate and up weights ``[E, F, H]`` (stacked, ``[out, in]``), fused or not, and the input they read."""
    gate_src, gate_rows = _row_selection(w, gate)
    up_src, up_rows = _row_selection(w, up)
    if gate_rows is not None or up_rows is not None:
        need(
            gate_src is up_src and gate_rows is not None and up_rows is not None,
            "gate/up split: gate and up are not two parts of one projection",
        )
        fused, x = projection(gate_src, "gate/up projection")
        g, u = fused[:, gate_rows(fused.shape[1]), :], fused[:, up_rows(fused.shape[1]), :]
        need(g.shape[1] == u.shape[1] and g.shape[1] > 0, "gate/up split: gate and up have different widths")
        return g, u, x
    g, x_g = projection(gate, "gate projection")
    u, x_u = projection(up, "up projection")
    need(x_g is x_u, "expert FFN: gate and up read different inputs")
    need(g.shape == u.shape, "expert FFN: gate and up weights have different shapes")
    return g, u, x_g


def _flat_indices(w: Walk, value: ir.Value, router: Router, rows: bool) -> None:
    """``Reshape(indices, [-1])``, as GatherND rows ``[T·k, 1]`` (``Unsqueeze`` at 1) when ``rows``."""
    if rows:
        unsq = w.node(value, "Unsqueeze", "expert index")
        need(sorted_axes(axes_of(unsq), 2) == [1], "expert index: not unsqueezed to [T·k, 1]")
        value = unsq.inputs[0]
    flat = w.node(value, "Reshape", "expert index")
    need(reshape_dims(flat) == [-1], "expert index: the top-k indices are not flattened with Reshape [-1]")
    need(flat.inputs[0] is router.indices, "expert index: not the router's top-k indices")


def batched_projection(w: Walk, router: Router) -> Projection:
    """Per (token, slot) expert weights, picked by ``GatherND(W, rows)`` (dynamo) or ``Gather(W, flat, axis=0)``
    (TorchScript), times the tokens as ``[T·k, in, 1]``, squeezed."""

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        squeeze = w.node(value, "Squeeze", what)
        need(sorted_axes(axes_of(squeeze), 3) == [2], f"{what}: Squeeze is not of the last axis")
        matmul = w.node(squeeze.inputs[0], "MatMul", what)
        gather = w.node(matmul.inputs[0], ("GatherND", "Gather"), f"{what}: per-token expert weights")
        if gather.op_type == "GatherND":
            need(attr_of(gather, "batch_dims", 0) == 0, f"{what}: GatherND with batch_dims")
        else:
            need(attr_of(gather, "axis", 0) == 0, f"{what}: Gather of expert weights is not along the experts axis")
        weight = const_weight(gather.inputs[0], 3, f"{what}: expert weights")
        need(
            weight.shape[0] == router.experts,
            f"{what}: {weight.shape[0]} experts' weights for a router of {router.experts}",
        )
        _flat_indices(w, gather.inputs[1], router, rows=gather.op_type == "GatherND")
        unsq = w.node(matmul.inputs[1], "Unsqueeze", f"{what}: tokens as [T·k, in, 1]")
        need(sorted_axes(axes_of(unsq), 3) == [2], f"{what}: tokens are not unsqueezed to [T·k, in, 1]")
        return weight, unsq.inputs[0]

    return projection


def stacked_projection(w: Walk) -> Projection:
    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        matmul = w.node(value, "MatMul", what)
        weight = const_weight(matmul.inputs[1], 3, f"{what}: stacked weights [E, in, out]")
        x = matmul.inputs[0]
        need(rank_of(x) in (2, 3), f"{what}: input {x.name} is not [T, in] or [E, T, in]")
        return np.ascontiguousarray(weight.transpose(0, 2, 1)), x

    return projection


def linear_projection(w: Walk) -> Projection:
    """One expert's projection as a stacked weight of one expert ``[1, out, in]``."""

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, ir.Value]:
        node = w.node(value, ("MatMul", "Gemm"), what)
        weight = const_weight(node.inputs[1], 2, f"{what}: weight")
        if node.op_type == "Gemm":
            need(len(node.inputs) < 3 or node.inputs[2] is None, f"{what}: Gemm with a bias")
            need(
                attr_of(node, "transA", 0) == 0 and attr_of(node, "alpha", 1.0) == 1.0,
                f"{what}: Gemm with transA/alpha",
            )
            if not attr_of(node, "transB", 0):
                weight = weight.T
        else:
            weight = weight.T
        need(rank_of(node.inputs[0]) == 2, f"{what}: input is not [T, in]")
        return np.ascontiguousarray(weight)[None], node.inputs[0]

    return projection
