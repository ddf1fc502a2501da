"""numpy reference implementations of LayerZero's own ops (the TensorRT plugins implement the same ops).

``ai.layerzero::MoE`` (opset 1), the skipping form of a mixture-of-experts block::

    y, mask = MoE(hidden[T, H], router_logits[T, E], w_gate[E, F, H], w_up[E, F, H], w_down[E, H, F],
                  top_k, normalize, scoring, activation, zeroing_threshold, path)

Expert weights are stored ``[out, in]``. Per token ``t``:

1. ``probs = scoring(logits[t])`` (``softmax`` over experts, or elementwise ``sigmoid``);
2. the ``top_k`` largest probs, ties broken towards the lower expert index (as ONNX Runtime's TopK);
3. ``w`` = those probs, divided by their sum when ``normalize``;
4. an expert whose ``w`` is below ``zeroing_threshold × max(w)`` is dropped (the rest is not renormalised);
5. ``y[t] = Σ_kept w_e · w_down[e] @ (act(w_gate[e] @ x_t) ⊙ (w_up[e] @ x_t))``;
   ``mask[t, e]`` is True exactly for the kept experts (the ones that run).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ACTIVATIONS", "SCORINGS", "moe_reference", "moe_routing"]

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu", "relu")


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    x = logits.astype(np.float64)
    if scoring == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    raise ValueError(f"scoring={scoring!r}; expected one of {SCORINGS}")


def _activation(x: np.ndarray, activation: str) -> np.ndarray:
    if activation == "silu":
        return x / (1.0 + np.exp(-x))
    if activation == "gelu":
        from math import erf, sqrt

        return 0.5 * x * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))
    if activation == "relu":
        return np.maximum(x, 0.0)
    raise ValueError(f"activation={activation!r}; expected one of {ACTIVATIONS}")


def moe_routing(
    logits: np.ndarray,
    *,
    top_k: int,
    normalize: bool | int,
    scoring: str = "softmax",
    zeroing_threshold: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Routing weights ``[T, E]`` (0 where an expert does not run) and the mask ``[T, E]`` bool."""
    logits = np.asarray(logits)
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in 1..{experts}")
    probs = _scores(logits, scoring)
    # A stable sort of -probs keeps the lower index first among equal probs (ORT TopK's tie order).
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, index, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    keep = weights >= zeroing_threshold * weights.max(axis=-1, keepdims=True, initial=0.0)
    dense = np.zeros((tokens, experts), np.float64)
    mask = np.zeros((tokens, experts), np.bool_)
    rows = np.arange(tokens)[:, None]
    dense[rows, index] = np.where(keep, weights, 0.0)
    mask[rows, index] = keep
    return dense, mask


def moe_reference(
    hidden: np.ndarray,
    logits: np.ndarray,
    w_gate: np.ndarray,
    w_up: np.ndarray,
    w_down: np.ndarray,
    *,
    top_k: int,
    normalize: bool | int,
    scoring: str = "softmax",
    activation: str = "silu",
    zeroing_threshold: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``(y [T, H], mask [T, E] bool)`` of ``ai.layerzero::MoE``; computed in float64, ``y`` returned in
    ``hidden``'s dtype. Only the experts in the mask are evaluated, on their tokens only."""
    hidden = np.asarray(hidden)
    experts, ffn, size = np.shape(w_gate)
    if np.shape(w_up) != (experts, ffn, size) or np.shape(w_down) != (experts, size, ffn):
        raise ValueError(
            f"expert weights: w_gate {np.shape(w_gate)}, w_up {np.shape(w_up)}, w_down {np.shape(w_down)}; "
            "expected [E, F, H], [E, F, H], [E, H, F]"
        )
    if hidden.ndim != 2 or hidden.shape[1] != size or np.shape(logits) != (hidden.shape[0], experts):
        raise ValueError(f"hidden {hidden.shape} / logits {np.shape(logits)}: expected [T, {size}] / [T, {experts}]")
    dense, mask = moe_routing(
        logits, top_k=top_k, normalize=normalize, scoring=scoring, zeroing_threshold=zeroing_threshold
    )
    x = hidden.astype(np.float64)
    y = np.zeros_like(x)
    for e in range(experts):
        tokens = np.flatnonzero(mask[:, e])
        if tokens.size == 0:
            continue
        xe = x[tokens]
        h = _activation(xe @ w_gate[e].astype(np.float64).T, activation) * (xe @ w_up[e].astype(np.float64).T)
        y[tokens] += dense[tokens, e, None] * (h @ w_down[e].astype(np.float64).T)
    return y.astype(hidden.dtype), mask
