"""numpy reference implementations of LayerZero's own ops (the TensorRT plugins implement the same ops).

``ai.layerzero::MoE`` (opset 1), the skipping form of a mixture-of-experts block::

    y, mask = MoE(hidden[T, H], router_logits[T, E], w_gate[E, F, H], w_up[E, F, H], w_down[E, H, F],
                  [b_gate[E, F], b_up[E, F], b_down[E, H], score_bias[E]],
                  top_k, normalize, scoring, activation, zeroing_threshold, path,
                  [activation_alpha, activation_limit, n_group, topk_group, routed_scaling_factor, routing,
                   jitter_eps])

Expert weights are stored ``[out, in]``; the expert biases (v2, optional inputs 5-7, absent = 0) add to each
projection's output. Every v2 attribute and input is optional and its default reproduces v1 exactly. Per token ``t``:

1. ``probs = scoring(logits[t])`` (``softmax`` over experts, or elementwise ``sigmoid``);
2. selection scores ``s = probs + score_bias`` (the bias only chooses: DeepSeek-V3's ``e_score_correction_bias``);
   with ``n_group`` > 1 the experts form ``n_group`` equal consecutive groups, a group's score is the sum of its
   two largest ``s``, and only the ``topk_group`` best groups (ties: lower group) stay selectable (the others'
   ``s`` = -inf: DeepSeek-V3, GLM4-MoE, dots1);
3. the ``top_k`` largest ``s``, ties broken towards the lower expert index (as ONNX Runtime's TopK);
4. ``w`` = the UNBIASED ``probs`` of those experts, divided by ``sum(w) + 1e-20`` when ``normalize``
   (DeepSeek-V3's exact formula; for softmax scores the sum is at least top_k / E, so the 1e-20 changes no
   float32 result and v1 semantics are kept), then × ``routed_scaling_factor``;
   ``routing="sparsemixer"`` replaces steps 1-4 by PhiMoE's sparsemixer (top-2, ``jitter_eps``; ``_sparsemixer``);
5. an expert whose ``w`` is below ``zeroing_threshold × max(w)`` is dropped (the rest is not renormalised);
6. ``y[t] = Σ_kept w_e · (w_down[e] @ glu(w_gate[e] @ x_t + b_gate[e], w_up[e] @ x_t + b_up[e]) + b_down[e])``;
   ``mask[t, e]`` is True exactly for the kept experts (the ones that run).

The router in the op (liblayerzero_ort.so only; ``passes/native_router.py``): inputs 15-16 ``router_weight [E, H]``
and ``router_bias [E]`` give ``logits = hidden @ router_weight^T + router_bias`` (input 1 then absent), and an
optional fourth output ``confidence [T] = max_e scoring(logits)[e]``; hidden may be ``[..., H]`` (y has its shape).

Quantized experts (``weight_format="q8"`` / ``"q4"``: block codes at inputs 2-4, float16 scales at 10-12): the
format and the reference of the native kernels' arithmetic (activations quantized per block, integer dots) are
``plugins/quant.py`` (``quantize_blocks``, ``dequantize_blocks``, ``moe_quant_reference``); on the dequantized
weights the semantics above hold up to the activations' 8-bit rounding.

``glu(g, u)`` by ``activation``: ``act(g) ⊙ u`` for ``silu``, ``gelu`` (exact, erf) and ``relu``; for
``swiglu_oai`` (GPT-OSS) ``g' = min(g, limit)``, ``u' = clip(u, -limit, limit)``,
``(u' + 1) ⊙ g' ⊙ sigmoid(alpha · g')`` with ``alpha = activation_alpha`` (default 1.702) and
``limit = activation_limit`` (default 7.0; ``inf``: no clamp).

``ai.layerzero::Attention`` (``attention_reference``; the op: ``plugins/ort/src/attention.h``), the attention core of
a decoder layer: ``softmax((q * q_scale) @ k^T * k_scale + mask)`` with NaN probabilities as 0, times ``v``, query
head ``h`` reading kv head ``h // (H / Hk)``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ACTIVATIONS",
    "NORMALIZE_EPS",
    "SCORINGS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "attention_reference",
    "glu",
    "moe_reference",
    "moe_routing",
]

SCORINGS = ("softmax", "sigmoid")
#: Added to the sum of the chosen weights before dividing (``normalize``), as DeepSeek-V3 / GLM4-MoE / dots1 do.
NORMALIZE_EPS = 1e-20
ACTIVATIONS = ("silu", "gelu", "relu", "swiglu_oai")
# swiglu_oai's defaults (GPT-OSS: config.swiglu_alpha, config.swiglu_limit); the node's attributes override them.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


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


def glu(
    gate: np.ndarray,
    up: np.ndarray,
    activation: str,
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
) -> np.ndarray:
    """The gated unit of an expert: ``act(gate) ⊙ up``, or GPT-OSS's clamped ``swiglu_oai`` (module docstring)."""
    if activation == "swiglu_oai":
        g = np.minimum(gate, limit)
        u = np.clip(up, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return _activation(gate, activation) * up


def moe_routing(
    logits: np.ndarray,
    *,
    top_k: int,
    normalize: bool | int,
    scoring: str = "softmax",
    zeroing_threshold: float = 0.0,
    score_bias: np.ndarray | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    routing: str = "topk",
    jitter_eps: float = 0.01,
) -> tuple[np.ndarray, np.ndarray]:
    """Routing weights ``[T, E]`` (0 where an expert does not run) and the mask ``[T, E]`` bool."""
    logits = np.asarray(logits)
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in 1..{experts}")
    if routing == "sparsemixer":
        if top_k != 2 or scoring != "softmax" or normalize or score_bias is not None or n_group != 1:
            raise ValueError("routing='sparsemixer' is top-2 of softmax scores, without normalize, bias or groups")
        index, weights = _sparsemixer(logits, jitter_eps)
    elif routing != "topk":
        raise ValueError(f"routing={routing!r}; expected 'topk' or 'sparsemixer'")
    else:
        index, weights = _topk_routing(logits, top_k, normalize, scoring, score_bias, n_group, topk_group)
    weights = weights * float(routed_scaling_factor)
    keep = weights >= zeroing_threshold * weights.max(axis=-1, keepdims=True, initial=0.0)
    dense = np.zeros((tokens, experts), np.float64)
    mask = np.zeros((tokens, experts), np.bool_)
    rows = np.arange(tokens)[:, None]
    dense[rows, index] = np.where(keep, weights, 0.0)
    mask[rows, index] = keep
    return dense, mask


def _sparsemixer(logits: np.ndarray, jitter_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """PhiMoE's sparsemixer at inference (transformers' ``sparsemixer``, ``training=False``), in float32 as the
    model computes it: the first choice is the ArgMax of the logits ``s``, weighed by the softmax of ``s`` with
    every logit ``j`` where ``(max - s_j) / max(|s_j|, max) > 2·jitter_eps`` at -inf; the second is the same
    with the first choice's logit at -inf (the relative gaps still measured against ``s``)."""
    s = np.asarray(logits, np.float32)
    rows = np.arange(s.shape[0])[:, None]
    choices, weights = [], []
    current = s
    for _ in range(2):
        top = current.max(axis=-1, keepdims=True)
        index = current.argmax(axis=-1)[:, None]  # the first of equal maxima, as ONNX ArgMax
        with np.errstate(divide="ignore", invalid="ignore"):
            far = (top - s) / np.maximum(np.abs(s), top) > np.float32(2 * jitter_eps)
        masked = np.where(far, -np.inf, current).astype(np.float64)
        e = np.exp(masked - masked.max(axis=-1, keepdims=True))
        weights.append(np.take_along_axis(e / e.sum(axis=-1, keepdims=True), index, axis=-1))
        choices.append(index)
        current = current.copy()
        current[rows, index] = -np.inf
    return np.concatenate(choices, axis=-1), np.concatenate(weights, axis=-1)


def _topk_routing(
    logits: np.ndarray,
    top_k: int,
    normalize: bool | int,
    scoring: str,
    score_bias: np.ndarray | None,
    n_group: int,
    topk_group: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(index [T, k], weights [T, k])`` of top-k routing (steps 1-4)."""
    probs = _scores(logits, scoring)
    select = _selection_scores(probs, score_bias, n_group, topk_group, top_k)
    # A stable sort of -select keeps the lower index first among equal scores (ORT TopK's tie order).
    index = np.argsort(-select, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, index, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORMALIZE_EPS)
    return index, weights


def _selection_scores(
    probs: np.ndarray, score_bias: np.ndarray | None, n_group: int, topk_group: int, top_k: int
) -> np.ndarray:
    """The scores experts are chosen by (step 2): ``probs + score_bias``, groups outside the best
    ``topk_group`` at -inf. With a bias or groups computed in float32, as the models compute it (which of two
    nearly equal sums is larger decides the choice); v1 routing keeps the float64 probs."""
    experts = probs.shape[1]
    if score_bias is None and n_group == 1:
        return probs
    select = probs.astype(np.float32)
    if score_bias is not None:
        bias = np.asarray(score_bias, np.float32).reshape(-1)
        if bias.shape != (experts,):
            raise ValueError(f"score_bias {np.shape(score_bias)}: expected [{experts}]")
        select = select + bias
    if n_group == 1:
        return select
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group}, topk_group={topk_group}: expected n_group | {experts}, 1..n_group")
    size = experts // n_group
    if size < 2 or top_k > topk_group * size:
        raise ValueError(f"n_group={n_group}, topk_group={topk_group}, top_k={top_k}: groups of {size} experts")
    grouped = select.reshape(-1, n_group, size)
    group_scores = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1)
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    keep = np.zeros(group_scores.shape, np.bool_)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(np.repeat(keep, size, axis=-1), select, -np.inf)


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
    b_gate: np.ndarray | None = None,
    b_up: np.ndarray | None = None,
    b_down: np.ndarray | None = None,
    activation_alpha: float = SWIGLU_ALPHA,
    activation_limit: float = SWIGLU_LIMIT,
    score_bias: np.ndarray | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    routing: str = "topk",
    jitter_eps: float = 0.01,
) -> tuple[np.ndarray, np.ndarray]:
    """``(y [T, H], mask [T, E] bool)`` of ``ai.layerzero::MoE``; computed in float64, ``y`` returned in
    ``hidden``'s dtype. Only the experts in the mask are evaluated, on their tokens only. A bias that is None
    is zero."""
    hidden = np.asarray(hidden)
    experts, ffn, size = np.shape(w_gate)
    if np.shape(w_up) != (experts, ffn, size) or np.shape(w_down) != (experts, size, ffn):
        raise ValueError(
            f"expert weights: w_gate {np.shape(w_gate)}, w_up {np.shape(w_up)}, w_down {np.shape(w_down)}; "
            "expected [E, F, H], [E, F, H], [E, H, F]"
        )
    if hidden.ndim != 2 or hidden.shape[1] != size or np.shape(logits) != (hidden.shape[0], experts):
        raise ValueError(f"hidden {hidden.shape} / logits {np.shape(logits)}: expected [T, {size}] / [T, {experts}]")
    biases = []
    for name, bias, shape in (
        ("b_gate", b_gate, (experts, ffn)),
        ("b_up", b_up, (experts, ffn)),
        ("b_down", b_down, (experts, size)),
    ):
        if bias is not None and np.shape(bias) != shape:
            raise ValueError(f"expert bias {name}: shape {np.shape(bias)}, expected {list(shape)}")
        biases.append(np.zeros(shape) if bias is None else np.asarray(bias, np.float64))
    b_g, b_u, b_d = biases
    dense, mask = moe_routing(
        logits,
        top_k=top_k,
        normalize=normalize,
        scoring=scoring,
        zeroing_threshold=zeroing_threshold,
        score_bias=score_bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        routing=routing,
        jitter_eps=jitter_eps,
    )
    x = hidden.astype(np.float64)
    y = np.zeros_like(x)
    for e in range(experts):
        tokens = np.flatnonzero(mask[:, e])
        if tokens.size == 0:
            continue
        xe = x[tokens]
        gate = xe @ w_gate[e].astype(np.float64).T + b_g[e]
        up = xe @ w_up[e].astype(np.float64).T + b_u[e]
        h = glu(gate, up, activation, activation_alpha, activation_limit)
        y[tokens] += dense[tokens, e, None] * (h @ w_down[e].astype(np.float64).T + b_d[e])
    return y.astype(hidden.dtype), mask


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    output_layout: str = "bhtd",
) -> np.ndarray:
    """``ai.layerzero::Attention`` in float64 from float32 inputs: q ``[B, H, T, D]``, k ``[B|1, Hk, L, D]``, v
    ``[B|1, Hk, L, Dv]``, mask broadcast to ``[B, H, T, L]``; returns float32 ``[B, H, T, Dv]`` (``"bthd"``:
    ``[B, T, H, Dv]``). ``q * q_scale`` is rounded to float32 first (the graph's Mul); ``k_scale`` scales the dot."""
    if k.shape[2] == 0:  # no keys: o = 0
        shape = q.shape[:3] + v.shape[3:]
        o = np.zeros(shape, np.float32)
        return np.ascontiguousarray(o.transpose(0, 2, 1, 3)) if output_layout == "bthd" else o
    qs = (q.astype(np.float32) * np.float32(q_scale)).astype(np.float64)
    ks = k.astype(np.float64)
    heads, kv_heads = q.shape[1], k.shape[1]
    repeat = heads // kv_heads
    ks = np.repeat(ks, repeat, axis=1)  # query head h reads kv head h // repeat
    vs = np.repeat(v.astype(np.float64), repeat, axis=1)
    s = (qs @ np.swapaxes(ks, -1, -2)) * float(np.float32(k_scale))
    if mask is not None:
        s = s + mask.astype(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    p = np.where(np.isnan(p), 0.0, p)
    o = (p @ vs).astype(np.float32)
    return np.ascontiguousarray(o.transpose(0, 2, 1, 3)) if output_layout == "bthd" else o
