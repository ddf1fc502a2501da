"""Numpy reference of ``ai.layerzero::SparseLinear``, the activation-sparse linear of issue 23.

    y [..., N], kept [...] int64 = SparseLinear(x [..., K], w, thresholds [K], scale?, bias? [N], w_scales?)

``w`` is the MatMul's ``B`` as it is, input-major (row ``i`` = input channel ``i``): ``weight_format="f"``
``[K, N]`` float32 / float16 / bfloat16 (bfloat16 given here as its uint16 bits, as numpy has no such type);
``"q8"`` ``[K, N]`` int8 and ``"q4"`` ``[K, N/2]`` uint8 codes with ``w_scales [K, N/32]`` float16
(``plugins/quant.py`` ``quantize_blocks(B, bits, 32, axis=-1)``: blocks of 32 along N, one input channel per
stored row), an element decoding as ``code * d``.

For every token row ``t`` (the leading dims flattened) and input channel ``i``:
``keep[t, i] = not (|x[t, i]| <= thresholds[i] * scale)`` (a NaN is kept, and propagates); ``y[t, :] = Σ over kept
i, ascending, of x[t, i] * W[i, :]`` in float32, plus ``bias``; ``kept[t]`` = the number of kept channels (the
realized sparsity is ``1 - kept / K``). Thresholds 0 keep every nonzero entry: the dense product. ``scale`` 0 is
the dense product too.
"""

from __future__ import annotations

import numpy as np

from layerzero.plugins.quant import BLOCK, FORMATS, dequantize_blocks

__all__ = ["SPARSE_FORMATS", "bf16_bits", "dense_weight", "sparse_linear_reference"]

#: weight_format values of the op.
SPARSE_FORMATS = ("f", "q8", "q4")


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even (NaN kept a NaN)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(w, np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def dense_weight(
    w: np.ndarray, w_scales: np.ndarray | None = None, weight_format: str = "f", bf16: bool = False
) -> np.ndarray:
    """``W [K, N]`` float32 as the op reads it (dequantized for q8 / q4; ``bf16``: ``w`` is bfloat16 bits)."""
    if weight_format not in SPARSE_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: expected one of {', '.join(SPARSE_FORMATS)}")
    if weight_format == "f":
        w = np.asarray(w)
        if bf16:
            return (np.asarray(w, np.uint16).astype(np.uint32) << 16).view(np.float32)
        return w.astype(np.float32)
    if w_scales is None:
        raise ValueError(f"weight_format={weight_format!r} needs w_scales")
    return dequantize_blocks(w, w_scales, FORMATS[weight_format], BLOCK, axis=-1)


def sparse_linear_reference(
    x: np.ndarray,
    w: np.ndarray,
    thresholds: np.ndarray | float,
    scale: float | None = 1.0,
    bias: np.ndarray | None = None,
    w_scales: np.ndarray | None = None,
    weight_format: str = "f",
    bf16: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(y [..., N] float32, kept [...] int64)`` of ``ai.layerzero::SparseLinear`` (module docstring)."""
    W = dense_weight(w, w_scales, weight_format, bf16)
    x = np.asarray(x, np.float32)
    k, n = W.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not K={k}")
    lead = x.shape[:-1]
    xt = x.reshape(-1, k)
    thr = np.broadcast_to(np.asarray(thresholds, np.float32), (k,))
    s = np.float32(1.0 if scale is None else scale)
    limit = (thr * s).astype(np.float32)
    keep = ~(np.abs(xt) <= limit[None, :])
    y = np.zeros((xt.shape[0], n), np.float32)
    for t in range(xt.shape[0]):
        acc = np.zeros(n, np.float32)
        for i in np.flatnonzero(keep[t]):
            acc += xt[t, i] * W[i]  # float32, ascending i
        y[t] = acc
    if bias is not None:
        y = y + np.asarray(bias, np.float32)[None, :]
    kept = keep.sum(axis=1).astype(np.int64)
    return y.reshape(*lead, n), kept.reshape(lead)
