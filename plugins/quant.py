"""LayerZero's block-quantized weight format (``q8`` / ``q4``) and a numpy reference of the native kernels' arithmetic.

The format (what ``ai.layerzero::MoE`` with ``weight_format="q8"`` / ``"q4"`` reads; ``plugins/ort/README.md``):

- symmetric blocks of ``block`` (32) consecutive elements along one axis of the matrix, one float16 scale ``d``
  per block, no zero point: an element decodes as ``code * d``;
- ``q8``: ``code`` is int8, one per element; the quantizer writes ``round(w / d)`` with ``d = max|w| / 127``
  (codes in -127..127; -128 decodes as -128 · d like any other);
- ``q4``: ``code`` is a signed 4-bit value stored offset by 8 (nibble = code + 8, 0..15; an element decodes as
  ``(nibble - 8) * d``), two per byte along the block axis: element ``2j`` in the LOW nibble of byte ``j``,
  element ``2j + 1`` in the HIGH nibble (ONNX Runtime's MatMulNBits order). The quantizer writes ``d = max|w| / 7``
  and codes -7..7 (symmetric; nibble 0, i.e. -8, is never written but decodes);
- ``d`` is ``max|w| / qmax`` rounded to float16 first, and the codes are ``round(w / d)`` with that stored ``d``
  (round half to even, clipped): the codes use the scale they are decoded with. A block of zeros has ``d = 0``.
  A block whose ``max|w| / qmax`` is beyond float16 (> 65504) is refused (``ValueError``);
- float16 scales, not float32: 2 bytes per 32 elements (q4 4.5 bits a weight, q8 8.5); the kernels convert them
  once per 16 blocks, and float16's 11-bit mantissa is finer than the 4- or 8-bit codes' own step;
- codes and scales are separate contiguous arrays, the block axis LAST in both: for ``w`` of shape
  ``[..., n, k]`` quantized along ``axis=-1``, codes ``[..., n, k]`` int8 (q8) or ``[..., n, k/2]`` uint8 (q4)
  and scales ``[..., n, k/32]`` float16. ``axis`` names the block axis of ``w``; it is moved last in the stored
  arrays (the other axes keep their order). The MoE weights quantize along their reduction axis, ``axis=-1`` of
  the ``[out, in]`` matrices (``w_gate``/``w_up`` ``[E, F, H]`` over H, ``w_down`` ``[E, H, F]`` over F): a row
  is one output's contiguous codes, which the row kernels stream. ``axis=-2`` of the same matrices puts the blocks
  along the OUTPUT dimension with one input channel per stored row (input-major: a skipped input channel is a
  skipped contiguous row, what activation-sparse kernels need; no kernel reads that layout yet);
- the block length must divide the axis (``k % 32 == 0``): the op refuses other shapes when the session is
  created (no padding);
- ``code_layout="chunk16"`` (q4 only; what ``layerzero compile`` writes): the same bytes of each row permuted for
  the row kernels (``chunk_q4_rows``): each whole chunk of 16 blocks (256 bytes) holds at byte ``64 s + 4 j``
  bytes ``4 s .. 4 s + 3`` of its block ``j`` (``s`` = 0..3), so that one 32-bit lane of a 64-byte step is one
  block in all 4 steps (an exact integer dot per block over the chunk, one float step per 16 blocks); the
  ``k / 32 % 16`` blocks after the last whole chunk stay in place. ``"rows"`` (the default) is the plain order.

The kernels' arithmetic (``qdot_rows``; ``moe_quant_reference`` for the whole op): each token's x (and each
expert's intermediate h) is quantized per 32-block to int8 the same symmetric way (``d_x = max|x| / 127`` in
float32, ``q = round(x * (127 / max|x|))``, clipped, ``d_x`` kept in float32), then per block the integer dot
``Σ q_w q_x`` (exact), times ``d_w · d_x`` (float32 product), summed over the row's blocks in float.
"""

from __future__ import annotations

import numpy as np

# The compiler writes the layout (passes/_quant_codes.py), these tests and references read it: one definition.
from layerzero.passes._quant_codes import CHUNK, chunk_q4_rows, unchunk_q4_rows

__all__ = [
    "BLOCK",
    "CHUNK",
    "FORMATS",
    "K_TILE",
    "chunk_q4_rows",
    "dequantize_blocks",
    "dequantize_k_blocks",
    "moe_quant_reference",
    "qdot_rows",
    "quantize_activations",
    "quantize_blocks",
    "quantize_k_blocks",
    "quantize_moe_weights",
    "unchunk_q4_rows",
]

BLOCK = 32
#: weight_format attribute value -> code bits.
FORMATS = {"q8": 8, "q4": 4}
_QMAX = {8: 127, 4: 7}


def _check(bits: int, block: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits={bits}: expected 8 or 4")
    if block < 2 or block % 2:
        raise ValueError(f"block={block}: expected an even length >= 2")


def quantize_blocks(w: np.ndarray, bits: int, block: int = BLOCK, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of ``w`` in symmetric blocks of ``block`` along ``axis`` (moved last; module docstring)."""
    _check(bits, block)
    w = np.moveaxis(np.asarray(w, np.float32), axis, -1)
    k = w.shape[-1]
    if k % block:
        raise ValueError(f"axis length {k} is not a multiple of the block length {block}")
    blocks = w.reshape(*w.shape[:-1], k // block, block)
    qmax = _QMAX[bits]
    amax = np.abs(blocks).max(axis=-1)
    ideal = amax / np.float32(qmax)
    if not np.all(np.isfinite(ideal)) or np.any(ideal > np.finfo(np.float16).max):
        raise ValueError("a block's scale max|w| / qmax is not finite in float16 (> 65504 or NaN)")
    scales = ideal.astype(np.float16)
    d = scales.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint(blocks / np.where(d > 0, d, 1)), 0)
    q = np.clip(q, -qmax, qmax).astype(np.int8).reshape(w.shape)
    scales = np.ascontiguousarray(scales)
    if bits == 8:
        return np.ascontiguousarray(q), scales
    nib = (q.astype(np.int16) + 8).astype(np.uint8)
    return np.ascontiguousarray(nib[..., 0::2] | (nib[..., 1::2] << 4)), scales


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The signed codes, one per element, block axis last (q4: low nibble first)."""
    if bits == 8:
        return np.asarray(codes).view(np.int8) if np.asarray(codes).dtype == np.uint8 else np.asarray(codes, np.int8)
    c = np.asarray(codes, np.uint8)
    out = np.empty((*c.shape[:-1], c.shape[-1] * 2), np.int8)
    out[..., 0::2] = (c & 0x0F).astype(np.int8) - 8
    out[..., 1::2] = (c >> 4).astype(np.int8) - 8
    return out


def dequantize_blocks(
    codes: np.ndarray, scales: np.ndarray, bits: int, block: int = BLOCK, axis: int = -1
) -> np.ndarray:
    """float32 ``w`` from ``(codes, scales)``: the block axis (last in the arrays) moved back to ``axis``."""
    _check(bits, block)
    q = unpack_codes(codes, bits).astype(np.float32)
    k = q.shape[-1]
    scales = np.asarray(scales)
    if scales.shape != (*q.shape[:-1], k // block) or k % block:
        raise ValueError(f"scales {scales.shape} do not fit codes of {q.shape} elements in blocks of {block}")
    w = (q.reshape(*q.shape[:-1], k // block, block) * scales.astype(np.float32)[..., None]).reshape(q.shape)
    return np.moveaxis(w, -1, axis)


def quantize_activations(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [..., k], d float32 [..., k / block])``: x quantized per block as the kernels do (exactly, in
    float32): ``d = max|x| / 127``, ``q = clip(round_half_even(x * (127 / max|x|)), -127, 127)``; 0 for a zero
    block."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], k // block, block)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float32)


#: Columns of a stored tile of ``quantize_k_blocks``' codes.
K_TILE = 8192


def _tile_width(bits: int) -> int:
    """Stored elements (q8 codes, q4 bytes) of a row of one full tile."""
    return K_TILE if bits == 8 else K_TILE // 2


def quantize_k_blocks(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """SparseLinear's q8 / q4 format of an input-major weight ``W [K, N]`` (``plugins/sparse.py``): symmetric
    blocks of 32 along K (the reduction axis; one float16 scale per (32-row block, column): ``scales [K/32, N]``,
    ``d`` and the codes as ``quantize_blocks``), one input channel per stored row. q8: codes ``[K, N]`` int8. q4:
    ``[K, N/2]`` uint8; within each 32-column block of a row, byte ``j`` holds column ``j`` in its low nibble and
    column ``j + 16`` in its high nibble (llama.cpp's Q4_0 order), each as code + 8. K and N multiples of 32.

    The codes are stored in column tiles of ``K_TILE`` (8192) columns: tile ``t`` (columns ``[8192 t, min(N, 8192 t
    + 8192))``) is a row-major ``[K, width]`` block (q4 ``width / 2`` bytes a row), the tiles one after the other
    in the ``[K, N]`` / ``[K, N/2]`` array (N <= 8192: one tile). q4: within a tile's row each whole 64-byte chunk
    (128 columns, blocks q = 0..3) holds at byte ``16 L + 4 q + m`` the byte ``4 L + m`` of block q (the order in
    which the kernel's byte / word unpacks of 4 rows give vpdpbusd lanes in column order); the bytes of a row's
    last partial chunk stay in block order. The kernel reads a tile's kept rows as contiguous segments
    (``plugins/ort/src/sparse_linear.h``); ``k_block_codes`` undoes both."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be [K, N], not {w.shape}")
    k, n = w.shape
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"W {w.shape}: K and N must be multiples of {BLOCK}")
    codes, scales = quantize_blocks(w, bits, BLOCK, axis=0)  # [N, K] (q4 packed along K), [N, K/32]
    q = unpack_codes(codes, bits).T  # signed [K, N]
    scales = np.ascontiguousarray(scales.T)
    if bits == 8:
        return _tiles(q.astype(np.int8), _tile_width(8)), scales
    nib = (q.astype(np.int16) + 8).astype(np.uint8).reshape(k, n // BLOCK, 2, BLOCK // 2)
    packed = nib[:, :, 0, :] | (nib[:, :, 1, :] << 4)
    return _tiles(packed.reshape(k, n // 2), _tile_width(4), chunks=True), scales


def _transpose_chunks(rows: np.ndarray) -> np.ndarray:
    """q4: each whole 64-byte chunk of a tile's rows ``[K, w]`` with byte ``4 L + m`` of its 32-column block
    ``q`` moved to ``16 L + 4 q + m`` (its own inverse); a row's last partial chunk as it is."""
    k, w = rows.shape
    whole = w // 64 * 64
    out = rows.copy()
    out[:, :whole] = rows[:, :whole].reshape(k, -1, 4, 4, 4).transpose(0, 1, 3, 2, 4).reshape(k, whole)
    return out


def _tiles(rows: np.ndarray, width: int, chunks: bool = False) -> np.ndarray:
    """``rows [K, C]`` in column tiles of ``width``: each tile's ``[K, w]`` block row-major, one after the other
    (``chunks``: q4's whole 64-byte chunks transposed, ``_transpose_chunks``)."""
    k, c = rows.shape
    tiles = [rows[:, t : t + width] for t in range(0, c, width)]
    return np.concatenate([(_transpose_chunks(t) if chunks else t).reshape(-1) for t in tiles]).reshape(k, c)


def _untiled(stored: np.ndarray, width: int, chunks: bool = False) -> np.ndarray:
    """The ``[K, C]`` rows of ``_tiles``' layout."""
    k, c = stored.shape
    flat = stored.reshape(-1)
    out = np.empty_like(stored)
    for t in range(0, c, width):
        w = min(width, c - t)
        tile = flat[k * t : k * (t + w)].reshape(k, w)
        out[:, t : t + w] = _transpose_chunks(tile) if chunks else tile
    return out


def k_block_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The signed codes ``[K, N]`` (int8) of ``quantize_k_blocks``' ``codes`` (tiled)."""
    if bits == 8:
        c = _untiled(np.asarray(codes), _tile_width(8))
        return c.view(np.int8) if c.dtype == np.uint8 else c.astype(np.int8)
    c = _untiled(np.asarray(codes, np.uint8), _tile_width(4), chunks=True)
    k, half = c.shape
    b = c.reshape(k, half // (BLOCK // 2), BLOCK // 2)
    out = np.empty((k, b.shape[1], 2, BLOCK // 2), np.int8)
    out[:, :, 0, :] = (b & 0x0F).astype(np.int8) - 8
    out[:, :, 1, :] = (b >> 4).astype(np.int8) - 8
    return out.reshape(k, half * 2)


def dequantize_k_blocks(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``W [K, N]`` of ``quantize_k_blocks``' ``(codes, scales)``."""
    q = k_block_codes(codes, bits).astype(np.float32)
    k, n = q.shape
    scales = np.asarray(scales)
    if scales.shape != (k // BLOCK, n) or k % BLOCK:
        raise ValueError(f"scales {scales.shape} do not fit [K/32, N] = [{k // BLOCK}, {n}]")
    return np.repeat(scales.astype(np.float32), BLOCK, axis=0) * q


def qdot_rows(
    codes: np.ndarray, scales: np.ndarray, bits: int, x: np.ndarray, block: int = BLOCK, absolute: bool = False
) -> np.ndarray:
    """``out [T, rows]`` (float64) of the row kernel: rows ``codes [rows, ...]`` against tokens ``x [T, k]``.
    ``absolute``: the sum of the blocks' terms' magnitudes instead (the scale of the kernel's float rounding)."""
    qw = unpack_codes(codes, bits).astype(np.int64)
    rows, k = qw.shape
    qx, dx = quantize_activations(x, block)
    nb = k // block
    dots = np.einsum("rbk,tbk->trb", qw.reshape(rows, nb, block), qx.astype(np.int64).reshape(-1, nb, block))
    d = np.asarray(scales, np.float16).astype(np.float32)[None, :, :] * dx[:, None, :]  # float32 products
    terms = d.astype(np.float64) * dots
    return (np.abs(terms) if absolute else terms).sum(axis=-1)


def quantize_moe_weights(
    w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, bits: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``([codes_gate, codes_up, codes_down], [scales ...])`` of an MoE block's ``[out, in]`` expert weights
    (blocks along the reduction axis: what ``weight_format="q8"/"q4"`` reads)."""
    out = [quantize_blocks(w, bits) for w in (w_gate, w_up, w_down)]
    return [c for c, _ in out], [s for _, s in out]


def moe_quant_reference(
    hidden: np.ndarray,
    logits: np.ndarray,
    codes: list[np.ndarray],
    scales: list[np.ndarray],
    bits: int,
    *,
    b_gate: np.ndarray | None = None,
    b_up: np.ndarray | None = None,
    b_down: np.ndarray | None = None,
    activation: str = "silu",
    activation_alpha: float = 1.702,
    activation_limit: float = 7.0,
    **routing: object,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(y, mask, h_slack)`` of the quantized ``ai.layerzero::MoE``: routing as ``moe_routing``, each kept
    expert's projections by ``qdot_rows`` (x quantized per block), ``h = glu(...)`` quantized per block again for
    the down projection, everything after the integer dots in float64.

    ``h_slack [T, H]``: a bound on how far the kernel's y can be from this one because an element of h rounds to
    the other neighbouring code (the kernel computes h in float32, this reference in float64: an element within
    ~1e-4 of a rounding boundary may go either way; each such flip moves y by ``weight · d_h · |w_down[:, j]|``).
    """
    from layerzero.plugins.reference import glu, moe_routing

    x = np.asarray(hidden, np.float32)
    dense, mask = moe_routing(logits, **routing)  # type: ignore[arg-type]
    tokens, size = x.shape
    y = np.zeros((tokens, size), np.float64)
    slack = np.zeros((tokens, size), np.float64)
    w_down = dequantize_blocks(codes[2], scales[2], bits).astype(np.float64)
    for e in range(dense.shape[1]):
        rows = np.flatnonzero(mask[:, e])
        if rows.size == 0:
            continue
        xe = x[rows]
        g = qdot_rows(codes[0][e], scales[0][e], bits, xe)
        u = qdot_rows(codes[1][e], scales[1][e], bits, xe)
        if b_gate is not None:
            g = g + np.asarray(b_gate, np.float64)[e]
        if b_up is not None:
            u = u + np.asarray(b_up, np.float64)[e]
        h = glu(g, u, activation, activation_alpha, activation_limit)
        o = qdot_rows(codes[2][e], scales[2][e], bits, h.astype(np.float32))
        if b_down is not None:
            o = o + np.asarray(b_down, np.float64)[e]
        y[rows] += dense[rows, e, None] * o
        # Elements of h near a rounding boundary of its block quantization (in code units).
        h32 = h.astype(np.float32)
        blocks = h32.reshape(len(rows), -1, BLOCK)
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            units = np.where(amax > 0, blocks * (127 / np.where(amax > 0, amax, 1)), 0).reshape(h.shape)
        near = np.abs(np.abs(units - np.floor(units)) - 0.5) < 1e-3
        step = np.repeat((amax[..., 0] / 127), BLOCK, axis=-1).reshape(h.shape)
        slack[rows] += dense[rows, e, None] * ((near * step) @ np.abs(w_down[e]).T)
    return y.astype(np.asarray(hidden).dtype), mask, slack
