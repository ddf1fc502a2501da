"""The expert part: one FFN ``down(glu(gate x + b_gate, up x + b_up)) + b_down`` per expert, and its variants.

``expert_ffn`` matches the whole part from the down projection's output; each piece below is a variant list.

Variants:
- gated unit (``GATED_UNITS``, rules as data): ``act(gate) ⊙ up`` with the activation (``_activation``) silu
  (``x * Sigmoid(x)``, either order), relu, gelu (the ``Gelu`` op without the tanh approximation, or its erf
  form ``x · 0.5 · (1 + erf(x / √2))`` in any association of the Muls); or GPT-OSS's clamped SwiGLU
  ``swiglu_oai``: ``(Clip(up, -l, l) + 1) ⊙ g ⊙ Sigmoid(alpha · g)``, ``g = Clip(gate, max=l)`` (both clamps,
  or neither: limit ``inf``; ``alpha`` 1 when the Sigmoid reads ``g`` itself);
- gate and up: two projections, or one fused projection split along its last axis (``Split`` or ``Slice``,
  concatenated or interleaved rows: ``gate_up[..., ::2]`` / ``[..., 1::2]``), de-interleaved at compile time
  into ``w_gate`` / ``w_up`` (and their biases);
- projection (which block shape reads the weights): ``batched_projection`` (``GatherND`` / ``Gather`` of
  stacked weights per (token, slot), batched ``MatMul``, ``Squeeze``: ``[E, out, in]`` times the tokens as
  columns, or, transposed (GPT-OSS), the tokens as rows times ``[E, in, out]``), ``stacked_projection``
  (``MatMul`` by stacked ``[E, in, out]``), ``linear_projection`` (one expert's ``MatMul`` / ``Gemm`` by a
  constant, or by ``weight[e]`` of a stacked constant left unfolded: ``selected_weight``),
  ``sorted_projection`` (JetMoE: rows sorted by expert, ``Split`` by the experts' counts, one ``Gemm`` per
  expert, ``Concat``);
- bias (each projection's own form, optional): ``Add`` of the per-slot bias rows (``GatherND`` / ``Gather`` of
  ``[E, out]`` by the same expert index), of a stacked ``[E, 1, out]``, or of one expert's ``[out]`` (or the
  ``Gemm``'s C);
- identity pairs ``Squeeze(Unsqueeze(v, a), a)`` the dynamo exporter leaves around a projection are walked
  through.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._moe.router import Router
from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    const_scalar,
    const_weight,
    furthest_of,
    near,
    need,
    rank_of,
    reshape_dims,
    sorted_axes,
    static_ints,
)

__all__ = [
    "GATED_UNITS",
    "ExpertFFN",
    "Gating",
    "Projection",
    "act_times_up",
    "batched_projection",
    "expert_ffn",
    "gate_up",
    "gated_unit",
    "linear_projection",
    "sorted_projection",
    "stack_experts",
    "stacked_projection",
]

# A projection part: (value, what) -> (weights [E, out, in], bias [E, out] or None, the input it reads).
Projection = Callable[[ir.Value, str], tuple[np.ndarray, np.ndarray | None, ir.Value]]

# swiglu_oai's defaults (GPT-OSS's config.swiglu_alpha / swiglu_limit; plugins/reference.py has the same).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclasses.dataclass
class Gating:
    """A gated unit ``glu(gate, up)``: the activation and, for ``swiglu_oai``, its alpha and clamp limit."""

    activation: str
    gate: ir.Value
    up: ir.Value
    alpha: float = SWIGLU_ALPHA
    limit: float = SWIGLU_LIMIT


@dataclasses.dataclass
class ExpertFFN:
    """The matched expert part: stacked weights ``[E, out, in]``, biases ``[E, out]`` (None: none), the unit."""

    activation: str
    w_gate: np.ndarray  # [E, F, H]
    w_up: np.ndarray  # [E, F, H]
    w_down: np.ndarray  # [E, H, F]
    x: ir.Value  # what the gate / up projections read
    b_gate: np.ndarray | None = None  # [E, F]
    b_up: np.ndarray | None = None  # [E, F]
    b_down: np.ndarray | None = None  # [E, H]
    alpha: float = SWIGLU_ALPHA
    limit: float = SWIGLU_LIMIT

    def fields(self) -> dict:
        """The ``MoEMatch`` fields of the expert part."""
        return {
            "activation": self.activation,
            "w_gate": self.w_gate,
            "w_up": self.w_up,
            "w_down": self.w_down,
            "b_gate": self.b_gate,
            "b_up": self.b_up,
            "b_down": self.b_down,
            "activation_alpha": self.alpha,
            "activation_limit": self.limit,
        }


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
    attempts = Attempts()
    for a, up in commuted(mul):
        with attempts.trying():
            act, gate = w.attempt(lambda a=a: _activation(w, a))
            return act, gate, up
    best = furthest_of(attempts, "neither factor of act(gate) × up is an activation", ties="last")
    raise NoMatch(f"expert FFN: {best.reason}", *best.nodes, progress=best.progress)


def _act_times_up(w: Walk, value: ir.Value) -> Gating:
    act, gate, up = act_times_up(w, value)
    return Gating(act, gate, up)


def _clip_bounds(node: ir.Node) -> tuple[float | None, float | None] | None:
    """``(min, max)`` of a ``Clip`` (None: that side unbounded); None when a bound is not a constant."""
    bounds = []
    for i, name in ((1, "min"), (2, "max")):
        if len(node.inputs) > i and node.inputs[i] is not None:
            c = const_scalar(node.inputs[i])
            if c is None:
                return None
        else:
            c = attr_of(node, name)  # opset < 11
            c = None if c is None else float(c)
        bounds.append(None if c is not None and math.isinf(c) else c)
    return bounds[0], bounds[1]


def _swiglu_oai(w: Walk, value: ir.Value) -> Gating:
    # (Clip(up, -l, l) + 1) * (g * Sigmoid(g * alpha)),  g = Clip(gate, max=l)   (GPT-OSS _apply_gate)
    mul = w.node(value, "Mul", "swiglu_oai: (up + 1) × glu")
    for plus_one, glu in commuted(mul):
        add = plus_one.producer()
        if add is None or add.op_type != "Add" or add.domain not in STD:
            continue
        for up_c, one in commuted(add):
            if const_scalar(one) is None or not near(const_scalar(one), 1.0):
                continue
            try:
                return w.attempt(lambda a=add, u=up_c, g=glu: _swiglu_oai_rest(w, a, u, g))
            except NoMatch:
                continue
    raise NoMatch("swiglu_oai: no factor is up + 1 times gate · Sigmoid(alpha · gate)")


def _swiglu_oai_rest(w: Walk, add: ir.Node, up_c: ir.Value, glu: ir.Value) -> Gating:
    w.nodes.append(add)
    inner = w.node(glu, "Mul", "swiglu_oai: gate × Sigmoid(alpha · gate)")
    for g, sig_value in commuted(inner):
        sig = sig_value.producer()
        if sig is None or sig.op_type != "Sigmoid" or sig.domain not in STD:
            continue
        scaled, alpha = sig.inputs[0], 1.0
        if scaled is not g:
            prod = scaled.producer()
            if prod is None or prod.op_type != "Mul" or prod.domain not in STD:
                continue
            found = [(a, b) for a, b in commuted(prod) if a is g and const_scalar(b) is not None]
            if not found:
                continue
            alpha = const_scalar(found[0][1])
            w.nodes.append(prod)
        w.nodes.append(sig)
        gate, up, limit = _swiglu_clamps(w, g, up_c)
        need(alpha > 0, f"swiglu_oai: alpha {alpha} is not positive")
        return Gating("swiglu_oai", gate, up, float(np.float32(alpha)), limit)
    raise NoMatch("swiglu_oai: the gate factor is not g × Sigmoid(alpha · g)")


def _swiglu_clamps(w: Walk, g: ir.Value, up_c: ir.Value) -> tuple[ir.Value, ir.Value, float]:
    """``(gate, up, limit)`` under ``g = Clip(gate, max=l)``, ``up_c = Clip(up, -l, l)``; no clamps: inf."""
    g_clip, u_clip = g.producer(), up_c.producer()
    clipped = [n is not None and n.op_type == "Clip" and n.domain in STD for n in (g_clip, u_clip)]
    if not any(clipped):
        return g, up_c, math.inf
    need(all(clipped), "swiglu_oai: only one of gate and up is clamped")
    g_bounds, u_bounds = _clip_bounds(g_clip), _clip_bounds(u_clip)
    need(g_bounds is not None and u_bounds is not None, "swiglu_oai: a clamp bound is not a constant")
    need(g_bounds[0] is None and g_bounds[1] is not None, "swiglu_oai: the gate is not clamped from above only")
    limit = g_bounds[1]
    need(
        u_bounds[1] is not None and near(u_bounds[1], limit) and u_bounds[0] is not None and near(u_bounds[0], -limit),
        f"swiglu_oai: up is not clamped to [-{limit}, {limit}]",
    )
    need(limit > 0, f"swiglu_oai: clamp limit {limit} is not positive")
    w.nodes.extend(n for n in (g_clip, u_clip) if n not in w.nodes)
    return g_clip.inputs[0], u_clip.inputs[0], float(np.float32(limit))


# Gated units (rules as data): name -> part matching ``glu(gate, up)`` from its output. Tried in order.
# swiglu_oai first: with alpha 1 its g · Sigmoid(g) is a silu, and act × up would take (up + 1) for the up.
GATED_UNITS: dict[str, Callable[[Walk, ir.Value], Gating]] = {
    "swiglu_oai": _swiglu_oai,
    "act-times-up": _act_times_up,
}


def gated_unit(w: Walk, value: ir.Value) -> Gating:
    """The first of ``GATED_UNITS`` that matches ``value``; else the NoMatch of the variant that got furthest
    (each variant's reason where they got equally far)."""
    producer = value.producer()
    if producer is None or producer.op_type != "Mul" or producer.domain not in STD:
        found = "a graph input or constant" if producer is None else f"{producer.op_type} ({producer.name})"
        # Every gated unit ends in a Mul; say so once instead of each variant's first failed check.
        raise NoMatch(
            f"expert FFN: the down projection reads {found}, not a gated unit (act(gate) × up or swiglu_oai); "
            "experts with one projection (JetMoE's attention experts) are no MoE FFN"
        )
    attempts = Attempts()
    for part in GATED_UNITS.values():
        with attempts.trying():
            return w.attempt(lambda p=part: p(w, value))
    raise furthest_of(attempts)


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
    w: Walk, gate: ir.Value, up: ir.Value, projection: Projection
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, ir.Value]:
    """Gate and up weights ``[E, F, H]`` (stacked, ``[out, in]``) and biases ``[E, F]`` (or None), fused or not,
    and the input they read. A fused projection's rows (and bias) are split / de-interleaved here."""
    gate_src, gate_rows = _row_selection(w, gate)
    up_src, up_rows = _row_selection(w, up)
    if gate_rows is not None or up_rows is not None:
        need(
            gate_src is up_src and gate_rows is not None and up_rows is not None,
            "gate/up split: gate and up are not two parts of one projection",
        )
        fused, bias, x = projection(gate_src, "gate/up projection")
        g_rows, u_rows = gate_rows(fused.shape[1]), up_rows(fused.shape[1])
        need(len(g_rows) == len(u_rows) and len(g_rows) > 0, "gate/up split: gate and up have different widths")
        need(not set(g_rows.tolist()) & set(u_rows.tolist()), "gate/up split: gate and up share rows")
        g, u = np.ascontiguousarray(fused[:, g_rows, :]), np.ascontiguousarray(fused[:, u_rows, :])
        b_g = None if bias is None else np.ascontiguousarray(bias[:, g_rows])
        b_u = None if bias is None else np.ascontiguousarray(bias[:, u_rows])
        return g, u, b_g, b_u, x
    g, b_g, x_g = projection(gate, "gate projection")
    u, b_u, x_u = projection(up, "up projection")
    need(x_g is x_u, "expert FFN: gate and up read different inputs")
    need(g.shape == u.shape, "expert FFN: gate and up weights have different shapes")
    return g, u, b_g, b_u, x_g


def expert_ffn(w: Walk, value: ir.Value, projection: Projection) -> ExpertFFN:
    """``value = down(glu(gate x + b_gate, up x + b_up)) + b_down``, every expert at once (one projection form)."""
    w_down, b_down, h = projection(value, "down projection")
    unit = gated_unit(w, h)
    w_gate, w_up, b_gate, b_up, x = gate_up(w, unit.gate, unit.up, projection)
    need(
        w_down.shape[2] == w_gate.shape[1],
        f"expert FFN: down weights {list(w_down.shape)} do not read the gate's {w_gate.shape[1]} features",
    )
    for name, bias in (("gate", b_gate), ("up", b_up), ("down", b_down)):
        if bias is not None:
            need(bias.dtype == w_gate.dtype, f"expert FFN: {name} bias is {bias.dtype}, not {w_gate.dtype}")
    return ExpertFFN(unit.activation, w_gate, w_up, w_down, x, b_gate, b_up, b_down, unit.alpha, unit.limit)


def stack_experts(ffns: list[ExpertFFN]) -> ExpertFFN:
    """One ``ExpertFFN`` of per-expert ones (unrolled blocks): same unit, weights concatenated; a bias some
    experts lack is zero for them."""
    first = ffns[0]
    units = {(f.activation, f.alpha, f.limit) for f in ffns}
    need(len(units) == 1, f"unrolled: experts use different gated units {sorted(map(str, units))}")
    shapes = {(f.w_gate.shape, f.w_up.shape, f.w_down.shape) for f in ffns}
    need(len(shapes) == 1, "unrolled: experts have different weight shapes")

    def biases(name: str, width: int) -> np.ndarray | None:
        parts = [getattr(f, name) for f in ffns]
        if all(p is None for p in parts):
            return None
        return np.concatenate([np.zeros((1, width), first.w_gate.dtype) if p is None else p for p in parts])

    ffn, hidden = first.w_gate.shape[1], first.w_down.shape[1]
    return ExpertFFN(
        first.activation,
        np.concatenate([f.w_gate for f in ffns]),
        np.concatenate([f.w_up for f in ffns]),
        np.concatenate([f.w_down for f in ffns]),
        first.x,
        biases("b_gate", ffn),
        biases("b_up", ffn),
        biases("b_down", hidden),
        first.alpha,
        first.limit,
    )


def _through_identity(w: Walk, value: ir.Value) -> ir.Value:
    """``Squeeze(Unsqueeze(v, a), a)`` → ``v`` (dynamo leaves such pairs around batched projections)."""
    while True:
        squeeze = value.producer()
        if squeeze is None or squeeze.op_type != "Squeeze" or squeeze.domain not in STD:
            return value
        unsq = squeeze.inputs[0].producer()
        if unsq is None or unsq.op_type != "Unsqueeze" or unsq.domain not in STD or len(squeeze.inputs[0].uses()) != 1:
            return value
        rank = rank_of(squeeze.inputs[0])
        a, b = axes_of(squeeze), axes_of(unsq)
        if rank is None or a is None or b is None or sorted_axes(a, rank) != sorted_axes(b, rank):
            return value
        w.nodes.extend(n for n in (squeeze, unsq) if n not in w.nodes)
        value = unsq.inputs[0]


def _biased(
    w: Walk, value: ir.Value, what: str, bias_part: Callable[[ir.Value], np.ndarray]
) -> tuple[ir.Value, np.ndarray | None]:
    """``Add(p, bias)`` (either order) → ``(p, bias [E, out])`` when ``bias_part`` accepts an operand;
    anything else → ``(value, None)``."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain not in STD:
        return value, None
    attempts = Attempts()
    for p, b in commuted(add):
        with attempts.trying():
            bias = w.attempt(lambda b=b: bias_part(b))
            if add not in w.nodes:
                w.nodes.append(add)
            return p, bias
    best = furthest_of(attempts)
    raise NoMatch(f"{what}: an Add whose operands are no bias: {best.reason}", *best.nodes, progress=best.progress)


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
    (TorchScript), times the tokens, squeezed: ``Squeeze(MatMul(W[e] [T·k, out, in], Unsqueeze(x, 2)), 2)``, or
    transposed (``is_transposed`` experts, GPT-OSS) ``Squeeze(MatMul(Unsqueeze(x, 1), W[e] [T·k, in, out]), 1)``;
    plus, optionally, the bias rows picked by the same index."""

    def pick(value: ir.Value, rank: int, what: str) -> np.ndarray:
        """``value`` = the rows of a constant ``[E, ...]`` of the given rank picked by the router's indices."""
        gather = w.node(value, ("GatherND", "Gather"), what)
        if gather.op_type == "GatherND":
            need(attr_of(gather, "batch_dims", 0) == 0, f"{what}: GatherND with batch_dims")
        else:
            need(attr_of(gather, "axis", 0) == 0, f"{what}: Gather of expert weights is not along the experts axis")
        weight = const_weight(gather.inputs[0], rank, what)
        need(
            weight.shape[0] == router.experts,
            f"{what}: {weight.shape[0]} experts' weights for a router of {router.experts}",
        )
        _flat_indices(w, gather.inputs[1], router, rows=gather.op_type == "GatherND")
        return weight

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, _through_identity(w, value), what, lambda b: pick(b, 2, f"{what}: bias"))
        squeeze = w.node(value, "Squeeze", what)
        axes = sorted_axes(axes_of(squeeze), 3)
        need(axes in ([1], [2]), f"{what}: Squeeze is not of axis 1 or 2 of [T·k, out, 1] / [T·k, 1, out]")
        matmul = w.node(squeeze.inputs[0], "MatMul", what)
        transposed = axes == [1]
        tokens, weights = (matmul.inputs[0], matmul.inputs[1]) if transposed else (matmul.inputs[1], matmul.inputs[0])
        weight = pick(weights, 3, f"{what}: per-token expert weights")
        if transposed:
            weight = np.ascontiguousarray(weight.transpose(0, 2, 1))
        unsq = w.node(tokens, "Unsqueeze", f"{what}: tokens as a matrix")
        need(
            sorted_axes(axes_of(unsq), 3) == ([1] if transposed else [2]),
            f"{what}: tokens are not unsqueezed to {'[T·k, 1, in]' if transposed else '[T·k, in, 1]'}",
        )
        need(bias is None or bias.shape[1] == weight.shape[1], f"{what}: bias width differs from the weights'")
        return weight, bias, unsq.inputs[0]

    return projection


def stacked_projection(w: Walk) -> Projection:
    """``MatMul(x, W [E, in, out])`` (+ a stacked bias ``[E, 1, out]``)."""

    def bias_part(value: ir.Value, what: str) -> np.ndarray:
        bias = const_weight(value, 3, f"{what}: bias [E, 1, out]")
        need(bias.shape[1] == 1, f"{what}: bias {list(bias.shape)} is not [E, 1, out]")
        return bias[:, 0, :]

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, value, what, lambda b: bias_part(b, what))
        matmul = w.node(value, "MatMul", what)
        weight = const_weight(matmul.inputs[1], 3, f"{what}: stacked weights [E, in, out]")
        x = matmul.inputs[0]
        need(rank_of(x) in (2, 3), f"{what}: input {x.name} is not [T, in] or [E, T, in]")
        need(bias is None or bias.shape == (weight.shape[0], weight.shape[2]), f"{what}: bias does not fit weights")
        return np.ascontiguousarray(weight.transpose(0, 2, 1)), bias, x

    return projection


def linear_projection(w: Walk) -> Projection:
    """One expert's projection as a stacked weight of one expert ``[1, out, in]``: ``MatMul`` (+ a bias
    ``[out]``) or ``Gemm`` (with or without C)."""

    def bias_part(value: ir.Value, what: str) -> np.ndarray:
        bias = const_weight(value, 1, f"{what}: bias [out]")
        return bias[None]

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, value, what, lambda b: bias_part(b, what))
        node = w.node(value, ("MatMul", "Gemm"), what)
        weight = selected_weight(w, node.inputs[1], f"{what}: weight")
        if node.op_type == "Gemm":
            need(
                attr_of(node, "transA", 0) == 0 and attr_of(node, "alpha", 1.0) == 1.0,
                f"{what}: Gemm with transA/alpha",
            )
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                need(bias is None, f"{what}: Gemm with a bias and an Add of another")
                c = const_array(node.inputs[2])
                need(
                    c is not None and c.dtype.kind == "f" and attr_of(node, "beta", 1.0) == 1.0,
                    f"{what}: Gemm's C is not a constant bias (beta 1)",
                )
                need(c.ndim == 1 or (c.ndim == 2 and c.shape[0] == 1), f"{what}: Gemm's C {list(c.shape)} is not [out]")
                bias = c.reshape(1, -1)
            if not attr_of(node, "transB", 0):
                weight = weight.T
        else:
            weight = weight.T
        need(rank_of(node.inputs[0]) == 2, f"{what}: input is not [T, in]")
        need(bias is None or bias.shape[1] == weight.shape[0], f"{what}: bias width differs from the weights'")
        return np.ascontiguousarray(weight)[None], bias, node.inputs[0]

    return projection


def selected_weight(w: Walk, value: ir.Value, what: str) -> np.ndarray:
    """One expert's 2-D weight: a constant, or ``weight[e]`` of a stacked constant left unfolded (torch's
    ``select``, JetMoE's ``self.weight[i]``): ``Gather(W, e, axis 0)`` with a scalar ``e``, ``Squeeze(Gather(W,
    [e]) | Slice(W, [e], [e + 1]), 0)``, each also under ``Transpose(perm [1, 0])``. The selecting nodes join
    the block (they go with it)."""
    if const_array(value) is not None:
        return const_weight(value, 2, what)
    nodes: list[ir.Node] = []
    transposed = False
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and node.domain in STD:
        perm = attr_of(node, "perm")
        need(perm is not None and list(perm) == [1, 0], f"{what}: {value.name} is Transpose with perm {perm}")
        nodes.append(node)
        transposed, value = True, node.inputs[0]
        node = value.producer()
    squeeze = None
    if node is not None and node.op_type == "Squeeze" and node.domain in STD:
        need(axes_of(node) == [0], f"{what}: {value.name} is a Squeeze of other axes than 0")
        squeeze = node
        nodes.append(node)
        node = node.inputs[0].producer()
    need(
        node is not None and node.op_type in ("Gather", "Slice") and node.domain in STD,
        f"{what}: {value.name} is not a constant weight",
    )
    stacked = const_weight(node.inputs[0], 3, f"{what}: the stacked weights of {value.name}")
    experts = stacked.shape[0]
    if node.op_type == "Gather":
        index = const_array(node.inputs[1])
        need(attr_of(node, "axis", 0) == 0, f"{what}: Gather {node.name} is not along the experts axis")
        need(
            index is not None and index.size == 1 and index.ndim == (0 if squeeze is None else 1),
            f"{what}: Gather {node.name} does not select one expert by a constant index",
        )
        e = int(index.reshape(-1)[0])
    else:
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        need(
            squeeze is not None and starts is not None and ends is not None and len(starts) == 1
            and axes in ([0], [-3]) and steps == [1],
            f"{what}: Slice {node.name} does not select one expert of the stacked weights",
        )  # fmt: skip
        e = starts[0] + experts if starts[0] < 0 else starts[0]
        need(ends[0] == e + 1, f"{what}: Slice {node.name} selects experts {starts[0]}..{ends[0]}, not one")
    need(-experts <= e < experts, f"{what}: expert {e} of {experts} stacked weights")
    nodes.append(node)
    w.nodes.extend(n for n in nodes if n not in w.nodes)
    weight = stacked[e]
    return weight.T if transposed else weight


def sorted_projection(w: Walk, experts: int, sizes: list[ir.Value]) -> Projection:
    """Rows sorted by expert (JetMoE's ``ParallelExperts``): ``Concat_e(Gemm(Split(x, sizes, axis 0)[e], W_e))``,
    one linear projection per expert reading its part. Every ``Split`` of the block must cut at the same
    ``sizes`` (appended here; the combine part checks they are the experts' token counts)."""
    linear = linear_projection(w)

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        concat = w.node(value, "Concat", f"{what}: the experts' rows")
        need(
            rank_of(value) == 2 and sorted_axes([int(attr_of(concat, "axis", 0))], 2) == [0],
            f"{what}: Concat is not along the rows",
        )
        need(len(concat.inputs) == experts, f"{what}: {len(concat.inputs)} parts for {experts} experts")
        weights, biases, split = [], [], None
        for e, part in enumerate(concat.inputs):
            weight, bias, x_e = linear(part, f"{what} of expert {e}")
            node = x_e.producer()
            need(
                node is not None and node.op_type == "Split" and node.domain in STD and len(node.outputs) == experts,
                f"{what} of expert {e}: does not read a Split of the rows into {experts} parts",
            )
            need(split is None or node is split, f"{what}: the experts read different Splits")
            need(node.outputs[e] is x_e, f"{what}: expert {e} reads part {list(node.outputs).index(x_e)}")
            split = node
            weights.append(weight)
            biases.append(bias)
        need(
            sorted_axes([int(attr_of(split, "axis", 0))], 2) == [0] and len(split.inputs) > 1,
            f"{what}: Split is not of the rows by sizes",
        )
        if split not in w.nodes:
            w.nodes.append(split)
        sizes.append(split.inputs[1])
        need(len({wt.shape for wt in weights}) == 1, f"{what}: the experts' weights differ in shape")
        bias = None
        if any(b is not None for b in biases):
            width = weights[0].shape[1]
            bias = np.concatenate([np.zeros((1, width), weights[0].dtype) if b is None else b for b in biases])
        return np.concatenate(weights), bias, split.inputs[0]

    return projection
