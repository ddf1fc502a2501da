"""The gated unit of an expert FFN, ``glu(gate, up)``, as variants (``GATED_UNITS``, rules as data):
act(gate) ⊙ up with silu / relu / gelu (the op or its erf form), or GPT-OSS's clamped SwiGLU ``swiglu_oai``
(``passes/_moe/experts.py``'s docstring has the forms)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    NoMatch,
    Walk,
    attr_of,
    commuted,
    const_scalar,
    furthest_of,
    near,
    need,
)

__all__ = ["GATED_UNITS", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "Gating", "act_times_up", "gated_unit"]


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
GATED_UNITS: dict[str, Callable[[Walk, ir.Value], Gating]] = {"swiglu_oai": _swiglu_oai, "act-times-up": _act_times_up}


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
