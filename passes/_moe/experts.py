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
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._moe.gating import GATED_UNITS, SWIGLU_ALPHA, SWIGLU_LIMIT, Gating, act_times_up, gated_unit
from layerzero.passes._moe.lazy import select_rows
from layerzero.passes._moe.projections import (
    Projection,
    batched_projection,
    linear_projection,
    sorted_projection,
    stacked_projection,
)
from layerzero.passes._moe.walk import (
    STD,
    Walk,
    attr_of,
    const_ints,
    need,
    rank_of,
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
        g, u = select_rows(fused, g_rows), select_rows(fused, u_rows)
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
