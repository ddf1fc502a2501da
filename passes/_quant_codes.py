"""The weight codes ``QuantizeWeights`` writes (``passes/quantize_weights.py``): MatMulNBits' blocks, the native MoE
op's expert codes, SparseLinear's input-major tiles; numpy only, no graph."""

from __future__ import annotations

import weakref

import numpy as np

from layerzero.errors import InvalidInputError
from layerzero.passes._moe.lazy import ExpertStack

__all__ = [
    "CHUNK",
    "EXPERT_BLOCK",
    "SPARSE_TILE",
    "check_format",
    "chunk_q4_rows",
    "dequantize_matrix",
    "native_expert_codes",
    "pack_codes",
    "quantize_matrix",
    "quantize_rows",
    "sparse_linear_codes",
    "unchunk_q4_rows",
]

#: The native op's block length (liblayerzero_ort.so implements 32 only).
EXPERT_BLOCK = 32
_QMAX = {4: 7, 8: 127}

#: Blocks of a q4 row chunk in ``code_layout="chunk16"``.
CHUNK = 16


def _chunk_order(row_bytes: int) -> np.ndarray:
    """The byte permutation of ``chunk_q4_rows`` for rows of ``row_bytes`` bytes: ``stored = plain[order]``."""
    if row_bytes % (EXPERT_BLOCK // 2):
        raise ValueError(f"a q4 row of {row_bytes} bytes is not whole 32-blocks (16 bytes each)")
    order = np.arange(row_bytes)
    whole = row_bytes // (CHUNK * EXPERT_BLOCK // 2) * (CHUNK * EXPERT_BLOCK // 2)
    # stored byte 64 s + 4 j + m of a chunk = plain byte 16 j + 4 s + m of that chunk
    chunk = np.arange(CHUNK * EXPERT_BLOCK // 2).reshape(CHUNK, 4, 4).transpose(1, 0, 2).reshape(-1)
    for c0 in range(0, whole, CHUNK * EXPERT_BLOCK // 2):
        order[c0 : c0 + chunk.size] = c0 + chunk
    return order


def chunk_q4_rows(codes: np.ndarray) -> np.ndarray:
    """q4 codes ``[..., k / 2]`` (plain rows) in ``code_layout="chunk16"`` (``plugins/quant.py`` module docstring)."""
    codes = np.asarray(codes, np.uint8)
    return np.ascontiguousarray(codes[..., _chunk_order(codes.shape[-1])])


def unchunk_q4_rows(codes: np.ndarray) -> np.ndarray:
    """The plain rows of ``chunk_q4_rows``' output."""
    codes = np.asarray(codes, np.uint8)
    out = np.empty_like(codes)
    out[..., _chunk_order(codes.shape[-1])] = codes
    return out


def check_format(bits: int, block: int) -> None:
    if bits not in _QMAX:
        raise InvalidInputError(f"weight quantization bits={bits}: expected 4 or 8")
    if block < 16 or block & (block - 1):
        raise InvalidInputError(f"weight quantization block={block}: expected a power of two >= 16")


def pack_codes(codes: np.ndarray, bits: int, pad: int = 0) -> np.ndarray:
    """uint8 codes ``[..., n]`` (0..2^bits-1) packed along the last axis (int4: element 2j low nibble of byte j; an
    odd count padded with ``pad``: ONNX Runtime pads zero points with the default one, 8)."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.full((*codes.shape[:-1], 1), pad, np.uint8)], axis=-1)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    if bits == 8:
        return packed[..., :count]
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out[..., :count]


def quantize_rows(
    w: np.ndarray, bits: int, block: int, symmetric: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(codes, scales, zero_points)`` of ``w [..., rows, K]`` in blocks of ``block`` along its last axis.

    codes: unsigned ``[..., rows, K / block, block]`` (0..2^bits-1, not packed); scales float32 ``[..., rows,
    K / block]``; zero points ``[..., rows, K / block]`` uint8, or None when symmetric (the default zero point
    ``2^(bits-1)``). The module docstring gives the formulas."""
    w = np.asarray(w, np.float32)
    k = w.shape[-1]
    if k % block:
        raise InvalidInputError(f"weight quantization: K={k} is not a multiple of the block {block}")
    blocks = w.reshape(*w.shape[:-1], k // block, block)
    if not np.all(np.isfinite(blocks)):
        raise InvalidInputError("weight quantization: a weight holds NaN or Inf")
    levels = (1 << bits) - 1
    if symmetric:
        qmax = _QMAX[bits]
        ideal = np.abs(blocks).max(axis=-1) / np.float32(qmax)
        if np.any(ideal > np.finfo(np.float16).max):
            raise InvalidInputError("weight quantization: a block's scale max|w| / qmax is beyond float16 (> 65504)")
        d = ideal.astype(np.float16).astype(np.float32)
        dd = d[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(dd > 0, np.rint(blocks / np.where(dd > 0, dd, 1)), 0)
        codes = (np.clip(q, -qmax, qmax) + (1 << (bits - 1))).astype(np.uint8)
        return codes, d, None
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = np.maximum(blocks.max(axis=-1), 0.0)
    d = ((hi - lo) / np.float32(levels)).astype(np.float32)
    safe = np.where(d > 0, d, np.float32(1))
    zp = np.clip(_round_away(-lo / safe), 0, levels)
    zp = np.where(d > 0, zp, 0).astype(np.uint8)
    q = _round_away(blocks / safe[..., None]) + zp[..., None]
    codes = np.where(d[..., None] > 0, np.clip(q, 0, levels), zp[..., None]).astype(np.uint8)
    return codes, d, zp


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's ``roundf``: halves away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def quantize_matrix(
    b: np.ndarray, bits: int, block: int, symmetric: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' inputs of a MatMul weight ``b [K, N]``: ``(B_q [N, K/block, block*bits/8] uint8, scales
    [N * K/block] float32, zero_points [N * ceil(K/block * bits/8)] uint8 or None)``."""
    check_format(bits, block)
    codes, scales, zp = quantize_rows(np.asarray(b).T, bits, block, symmetric)
    n, nb = scales.shape
    packed = pack_codes(codes, bits)  # [N, nb, block*bits/8]
    zero_points = None if zp is None else pack_codes(zp, bits, pad=1 << (bits - 1)).reshape(-1)
    return packed, scales.reshape(n * nb), zero_points


def dequantize_matrix(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int, block: int, k: int, n: int
) -> np.ndarray:
    """float32 ``[K, N]`` of MatMulNBits' ``B``, ``scales`` and ``zero_points`` (the numpy reference)."""
    nb = -(-k // block)
    codes = _unpack(np.asarray(packed).reshape(n, nb, -1), bits, block).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, nb), 1 << (bits - 1), np.float32)
    else:
        per_row = -(-nb * bits // 8)
        zp = _unpack(np.asarray(zero_points).reshape(n, per_row), bits, nb).astype(np.float32)
    s = np.asarray(scales, np.float32).reshape(n, nb)
    w = ((codes - zp[..., None]) * s[..., None]).reshape(n, nb * block)[:, :k]
    return np.ascontiguousarray(w.T)


#: Expert codes and scales by their stack's key, bits and part, while some model holds them (weakly: an entry goes
#: with its array): the verification's quantized-dense reference reads the compiled model's file again and gets the
#: same arrays, read-only to both (its own copy would double the int4 bytes the compile holds).
_SHARED_CODES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def native_expert_codes(w: np.ndarray | ExpertStack, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The native op's ``(codes, scales)`` of ``[E, out, in]`` experts (blocks of 32 along ``in``): q8 int8 codes,
    q4 uint8 nibbles in ``code_layout="chunk16"`` (``plugins/quant.py`` ``chunk_q4_rows``); float16 scales ``[E,
    out, in / 32]`` (``plugins/quant.py`` ``quantize_blocks(axis=-1)``).

    An ``ExpertStack`` is quantized one expert at a time into the output (each block is quantized alone, so the
    codes are the whole stack's): its float experts are never held together."""
    if isinstance(w, ExpertStack):
        if w.key is not None:
            codes, scales = _SHARED_CODES.get((w.key, bits, "codes")), _SHARED_CODES.get((w.key, bits, "scales"))
            if codes is not None and scales is not None:
                return codes, scales
        codes = scales = None
        for e in range(w.shape[0]):
            c, s = native_expert_codes(w.expert(e)[None], bits)
            if codes is None:
                codes = np.empty((w.shape[0], *c.shape[1:]), c.dtype)
                scales = np.empty((w.shape[0], *s.shape[1:]), s.dtype)
            codes[e], scales[e] = c[0], s[0]
        if w.key is not None:
            codes.flags.writeable = scales.flags.writeable = False  # shared: nobody writes them
            _SHARED_CODES[(w.key, bits, "codes")], _SHARED_CODES[(w.key, bits, "scales")] = codes, scales
        return codes, scales
    codes, scales, _ = quantize_rows(w, bits, EXPERT_BLOCK, symmetric=True)
    flat = codes.reshape(*codes.shape[:-2], -1)
    if bits == 8:
        stored = (flat.astype(np.int16) - 128).astype(np.int8)
    else:
        stored = chunk_q4_rows(pack_codes(flat, 4))
    return np.ascontiguousarray(stored), np.ascontiguousarray(scales.astype(np.float16))


#: Columns of a stored tile of SparseLinear's q8 / q4 codes (the kernel's format: ``sparse_linear_codes``).
SPARSE_TILE = 8192


def sparse_linear_codes(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """SparseLinear's ``(w, w_scales)`` of a MatMul weight ``W [K, N]`` (input-major, blocks of 32 along K): q8
    ``[K, N]`` int8, q4 ``[K, N/2]`` uint8, stored in column tiles of ``SPARSE_TILE`` columns (tile ``t`` a
    row-major ``[K, width]`` block, the tiles one after the other; q4: each whole 64-byte chunk of a tile's row
    with its 4 blocks' 4-byte groups transposed); float16 scales ``[K/32, N]`` (``plugins/quant.py``
    quantize_k_blocks)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    # The experts' rows quantization of W^T ([N, K]: blocks along K), laid out input-major; equal to plugins/quant.py's
    # quantize_k_blocks (tests/compiler/test_sparse_quant.py checks the codes).
    codes, scales, _ = quantize_rows(w.T, bits, EXPERT_BLOCK, symmetric=True)
    offset = codes.reshape(n, k).T  # stored code + 128 (q8) / + 8 (q4), [K, N]
    scales = np.ascontiguousarray(scales.reshape(n, k // EXPERT_BLOCK).T.astype(np.float16))
    if bits == 8:
        rows = (offset.astype(np.int16) - 128).astype(np.int8)
    else:
        nib = offset.astype(np.uint8).reshape(k, n // EXPERT_BLOCK, 2, EXPERT_BLOCK // 2)
        rows = (nib[:, :, 0, :] | (nib[:, :, 1, :] << 4)).reshape(k, n // 2)
    per_tile = SPARSE_TILE * bits // 8  # stored elements of a full tile's row
    tiles = []
    for c in range(0, rows.shape[1], per_tile):
        tile = rows[:, c : c + per_tile].copy()
        if bits == 4:  # each whole 64-byte chunk: byte 4 L + m of its block q at 16 L + 4 q + m
            whole = tile.shape[1] // 64 * 64
            chunks = tile[:, :whole].reshape(k, -1, 4, 4, 4)
            tile[:, :whole] = chunks.transpose(0, 1, 3, 2, 4).reshape(k, whole)
        tiles.append(tile.reshape(-1))
    return np.concatenate(tiles).reshape(rows.shape), scales
