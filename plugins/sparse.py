"""Numpy reference of ``ai.layerzero::SparseLinear``, the activation-sparse linear of issue 23.

    y [..., N], kept [...] int64 = SparseLinear(x [..., K], w, thresholds [K], scale?, bias? [N], w_scales?)

``w`` is the MatMul's ``B``, input-major (row ``i`` = input channel ``i``): ``weight_format="f"`` ``[K, N]``
float32 / float16 / bfloat16 as it is (bfloat16 given here as its uint16 bits, as numpy has no such type);
``"q8"`` ``[K, N]`` int8 and ``"q4"`` ``[K, N/2]`` uint8 codes with ``w_scales [K/32, N]`` float16
(``plugins/quant.py`` ``quantize_k_blocks``: blocks of 32 along K, one input channel per stored row; q4: within
each 32-column block of a row, byte ``j`` = column ``j`` (low nibble) and ``j + 16`` (high), code + 8; the rows
stored in column tiles of 8192, ``K_TILE``).

For every token row ``t`` (the leading dims flattened) and input channel ``i``:
``keep[t, i] = not (|x[t, i]| <= thresholds[i] * scale)`` (a NaN is kept, and propagates); ``kept[t]`` = the number
of kept channels (the realized sparsity is ``1 - kept / K``). Then, in float32:

- ``"f"``: ``y[t, :] = Σ over kept i, ascending, of x[t, i] * W[i, :]`` (one rounding per term: the kernels' fused
  multiply-add; the portable build's multiply and add is within 1e-5), plus ``bias``;
- ``"q8"`` / ``"q4"`` (integer arithmetic over input channels, as MatMulNBits / llama.cpp): the kept x (a skipped
  channel as 0) quantized per 32-channel block ``b`` as llama.cpp's Q8_0 (``d_x[b] = max|x| / 127``, a NaN
  winning; ``q = clip(round_half_even(x * (127 / max|x|)), ±127)``, 0 for a NaN or a zero block); for each block
  with a kept channel, ascending: ``y = y + float32(isum[b, :]) * (d_w[b, :] * d_x[b])`` (float32 products, no
  fused multiply-add), ``isum`` the exact integer dot of the block's x codes with its weight codes. Then ``+ bias``.
  This is the kernels' exact arithmetic: every build agrees with it bitwise.

Thresholds 0 keep every nonzero entry: the dense product (q8 / q4: of the int8-rounded x). ``scale`` 0 is the dense
product too.
"""

from __future__ import annotations

import numpy as np

from layerzero.plugins.quant import BLOCK, FORMATS, dequantize_k_blocks, k_block_codes

__all__ = ["SPARSE_FORMATS", "bf16_bits", "dense_weight", "quantize_kept", "sparse_linear_reference"]

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
    return dequantize_k_blocks(w, w_scales, FORMATS[weight_format])


def quantize_kept(x: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [T, K], d float32 [T, K/32])``: the kept entries of ``x [T, K]`` (a skipped one as 0) quantized
    per 32-channel block as the q8 / q4 kernels do (module docstring; ``plugins/quant.py`` quantize_activations,
    NaN made explicit)."""
    xm = np.where(keep, np.asarray(x, np.float32), np.float32(0))
    t, k = xm.shape
    blocks = xm.reshape(t, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)  # NaN wins
    d = (amax / np.float32(127)).astype(np.float32)
    ok = (amax > 0) & (amax <= np.finfo(np.float32).max)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(ok, np.float32(127) / np.where(ok, amax, 1), 0).astype(np.float32)
        v = np.rint(blocks * inv[..., None])
    v = np.where(np.isnan(v), 0, np.clip(v, -127, 127))
    return v.astype(np.int8).reshape(t, k), d


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
    if weight_format in FORMATS:
        return _quantized_reference(x, w, thresholds, scale, bias, w_scales, FORMATS[weight_format])
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


def _keep(x: np.ndarray, k: int, thresholds: np.ndarray | float, scale: float | None) -> np.ndarray:
    thr = np.broadcast_to(np.asarray(thresholds, np.float32), (k,))
    s = np.float32(1.0 if scale is None else scale)
    limit = (thr * s).astype(np.float32)
    return ~(np.abs(x) <= limit[None, :])


def _quantized_reference(x, w, thresholds, scale, bias, w_scales, bits: int) -> tuple[np.ndarray, np.ndarray]:
    if w_scales is None:
        raise ValueError(f"weight_format=q{bits} needs w_scales")
    codes = k_block_codes(w, bits).astype(np.int32)
    k, n = codes.shape
    sw = np.asarray(w_scales).astype(np.float32)
    if sw.shape != (k // BLOCK, n):
        raise ValueError(f"w_scales {sw.shape} is not [K/32, N] = [{k // BLOCK}, {n}]")
    x = np.asarray(x, np.float32)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not K={k}")
    lead = x.shape[:-1]
    xt = x.reshape(-1, k)
    keep = _keep(xt, k, thresholds, scale)
    q, d = quantize_kept(xt, keep)
    nb = k // BLOCK
    y = np.zeros((xt.shape[0], n), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(xt.shape[0]):
            kb_keep = keep[t].reshape(nb, BLOCK).any(axis=1)
            qt = q[t].astype(np.int32).reshape(nb, BLOCK)
            for b in np.flatnonzero(kb_keep):
                isum = qt[b] @ codes[b * BLOCK : (b + 1) * BLOCK]  # exact
                m = (sw[b] * d[t, b]).astype(np.float32)
                y[t] = y[t] + isum.astype(np.float32) * m
    if bias is not None:
        y = y + np.asarray(bias, np.float32)[None, :]
    kept = keep.sum(axis=1).astype(np.int64)
    return y.reshape(*lead, n), kept.reshape(lead)
