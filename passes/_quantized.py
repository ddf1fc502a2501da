"""One reader of a quantized weight: ``com.microsoft::MatMulNBits`` and ``DequantizeLinear`` of constants.

``quantized_weight(node)`` reads a MatMulNBits node (its ``B``, ``scales``, ``zero_points``; attributes ``K``,
``N``, ``bits`` 2 / 4 / 8, ``block_size``) or a DequantizeLinear whose inputs are constants (int8 / uint8 /
int4 / uint4 / int16 / uint16 ``x`` of rank 2; per tensor, per axis, or blocked along axis 0), as a
:class:`QuantizedWeight`: the weight in its math form ``[K, N]`` (``A @ W``), with

- ``dequantize()`` / ``rows(ks)``: the float weight, ONNX Runtime's arithmetic exactly: ``(q - zero_point) *
  scale`` in float32 (the integer difference is exact, the product rounds once), cast to the output type;
- its zero structure without dequantizing it: an element is zero when its block's scale is 0 or its code equals
  its zero point (and the scale is finite). ``zero_rows()`` (input channels, K) and ``zero_cols()`` (output
  channels, N) first look at one column / row for candidates, then read only those (``zero_lines`` of
  passes/_structured/leaves.py does the same for float weights); ``all_zero()``;
- the rewrites structured zeros needs: ``take_cols`` (N: always exact: the blocks run along K) and
  ``take_rows`` (K: exact only when the removed rows are whole blocks, ``removable_rows`` says which; per-column
  or per-tensor scales slice freely), ``zeroed`` (every scale 0: the weight is zero).

MatMulNBits layout (ONNX Runtime's contrib-op schema): ``B [N, k_blocks, blob]`` uint8, ``blob = block * bits /
8``, element ``k`` of row ``n`` at bits ``(k % block) * bits`` of blob ``k // block``, low bits first;
``scales [N, k_blocks]`` (or flattened); ``zero_points`` packed uint8 ``[N, ceil(k_blocks * bits / 8)]`` the same
way, or unpacked in A's float type ``[N, k_blocks]``; absent: ``2 ** (bits - 1)``. ``g_idx`` (input 4) is not
read (None); the bias (input 5) is sliced with the columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array

__all__ = [
    "MS_DOMAIN",
    "QuantizedWeight",
    "is_matmul_nbits",
    "is_zero_weight",
    "quantized_operand",
    "quantized_weight",
]

MS_DOMAIN = "com.microsoft"
_CHUNK = 256  # candidate lines read per step (a bounded temporary)
_INT_KINDS = ("int8", "uint8", "int4", "uint4", "int16", "uint16")

Constant = Callable[[str, np.ndarray], ir.Value]
#: The inputs of each form, by position.
_INPUTS = {
    "nbits": ("A", "B", "scales", "zero_points", "g_idx", "bias"),
    "dq": ("x", "scale", "zero_point"),
}


def is_matmul_nbits(node: ir.Node | None) -> bool:
    return node is not None and node.domain == MS_DOMAIN and node.op_type == "MatMulNBits"


def _attr(node: ir.Node, name: str, default: int | None = None) -> int | None:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Codes (int32) of bytes holding ``8 / bits`` codes each, low bits first, along the last axis."""
    packed = np.asarray(packed, np.uint8)
    if bits == 8:
        return packed.astype(np.int32)
    per, mask = 8 // bits, (1 << bits) - 1
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * per), np.int32)
    for i in range(per):
        out[..., i::per] = (packed >> (i * bits)) & mask
    return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of ``_unpack`` (the last axis padded with zeros to whole bytes)."""
    codes = np.asarray(codes, np.int64)
    if bits == 8:
        return codes.astype(np.uint8)
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.int64)], axis=-1)
    out = np.zeros((*codes.shape[:-1], codes.shape[-1] // per), np.int64)
    for i in range(per):
        out |= codes[..., i::per] << (i * bits)
    return out.astype(np.uint8)


@dataclasses.dataclass
class QuantizedWeight:
    """A quantized weight in its math form ``[K, N]`` (module docstring). ``block``: rows of K per scale (``K``
    for one scale per column or per tensor, 1 for one per row); ``scales`` / ``zero_points`` ``[K / block, N or
    1]`` (broadcast along N for per-row / per-tensor scales)."""

    node: ir.Node  # the MatMulNBits, or the DequantizeLinear
    form: str  # "nbits" | "dq"
    k: int
    n: int
    bits: int
    block: int
    scales: np.ndarray  # float32 [KB, N | 1]
    zero_points: np.ndarray  # float64 [KB, N | 1] (integer values, or MatMulNBits' float zero points)
    out_dtype: np.dtype
    raw: dict[str, np.ndarray]  # the node's constant inputs as stored
    layout: str  # nbits: "blocked"; dq: "blocked" (axis 0) | "column" | "row" | "tensor"

    # ---------------------------------------------------------------------------------------------- codes
    def code_rows(self, ks: np.ndarray) -> np.ndarray:
        """Codes ``[len(ks), N]`` (int32) of rows ``ks`` of K."""
        ks = np.asarray(ks, np.int64)
        if self.form == "dq":
            return np.asarray(self.raw["x"][ks]).astype(np.int32)
        b = self.raw["B"]
        within = (ks % self.block) * self.bits
        picked = b[:, ks // self.block, within // 8].astype(np.int32)  # [N, len]
        return ((picked >> (within % 8)) & ((1 << self.bits) - 1)).T

    def code_cols(self, ns: np.ndarray) -> np.ndarray:
        """Codes ``[K, len(ns)]`` (int32) of columns ``ns`` of N."""
        ns = np.asarray(ns, np.int64)
        if self.form == "dq":
            return np.asarray(self.raw["x"][:, ns]).astype(np.int32)
        b = self.raw["B"][ns]
        return _unpack(b.reshape(len(ns), -1), self.bits)[:, : self.k].T

    def _kb(self, ks: np.ndarray) -> np.ndarray:
        return np.asarray(ks, np.int64) // self.block

    def _zero_elements(self, codes: np.ndarray, ks: np.ndarray, ns: np.ndarray | slice) -> np.ndarray:
        kb = self._kb(ks)
        s = self.scales[kb][:, ns] if self.scales.shape[1] > 1 else self.scales[kb]
        z = self.zero_points[kb][:, ns] if self.zero_points.shape[1] > 1 else self.zero_points[kb]
        return (s == 0) | ((codes == z) & np.isfinite(s))

    # ------------------------------------------------------------------------------------- zero structure
    def zero_rows(self) -> np.ndarray:
        """Rows of K whose every element is zero (bool ``[K]``)."""
        rows = np.zeros(self.k, bool)
        first = self._zero_elements(self.code_cols(np.array([0])), np.arange(self.k), slice(0, 1))[:, 0]
        candidates = np.flatnonzero(first)
        for start in range(0, candidates.size, _CHUNK):
            ks = candidates[start : start + _CHUNK]
            rows[ks] = self._zero_elements(self.code_rows(ks), ks, slice(None)).all(axis=1)
        return rows

    def zero_cols(self) -> np.ndarray:
        """Columns of N whose every element is zero (bool ``[N]``)."""
        cols = np.zeros(self.n, bool)
        first = self._zero_elements(self.code_rows(np.array([0])), np.array([0]), slice(None))[0]
        candidates = np.flatnonzero(first)
        every = np.arange(self.k)
        for start in range(0, candidates.size, _CHUNK):
            ns = candidates[start : start + _CHUNK]
            cols[ns] = self._zero_elements(self.code_cols(ns), every, ns).all(axis=0)
        return cols

    def all_zero(self) -> bool:
        return bool(self.zero_cols().all())

    # ---------------------------------------------------------------------------------------- the floats
    def rows(self, ks: np.ndarray) -> np.ndarray:
        """Dequantized rows ``[len(ks), N]`` of K, in the output type (ONNX Runtime's arithmetic)."""
        ks = np.asarray(ks, np.int64)
        kb = self._kb(ks)
        diff = (self.code_rows(ks).astype(np.float64) - self.zero_points[kb]).astype(np.float32)
        with np.errstate(all="ignore"):
            return (diff * self.scales[kb]).astype(self.out_dtype)

    def dequantize(self) -> np.ndarray:
        return self.rows(np.arange(self.k))

    # ------------------------------------------------------------------------------------------ rewrites
    def removable_rows(self, dead: np.ndarray) -> np.ndarray:
        """Of the rows ``dead`` (bool ``[K]``), those that can go exactly: every row of a blocked weight's
        block must go with it (re-blocking would re-quantize)."""
        dead = np.asarray(dead, bool)
        if self.layout != "blocked":
            return dead
        blocks = np.zeros(-(-self.k // self.block), bool)
        for b in range(blocks.size):
            blocks[b] = dead[b * self.block : (b + 1) * self.block].all()
        return np.repeat(blocks, self.block)[: self.k]

    def take_cols(self, cols: np.ndarray, constant: Constant) -> int:
        """Keep output columns ``cols``; the elements removed."""
        cols = np.asarray(cols, np.int64)
        node, hint = self.node, self.node.name or "lz_quantized"
        if self.form == "nbits":
            new = {"B": self.raw["B"][cols]}
            new["scales"] = self._nbits_rows(self.raw["scales"], cols)
            if "zero_points" in self.raw:
                new["zero_points"] = self._nbits_rows(self.raw["zero_points"], cols)
            if "bias" in self.raw:
                new["bias"] = self.raw["bias"][cols]
            node.attributes["N"] = ir.AttrInt64("N", len(cols))
        else:
            new = {"x": self.raw["x"][:, cols]}
            for name in ("scale", "zero_point"):
                if name in self.raw:
                    array = self.raw[name]
                    if self.layout == "blocked":
                        new[name] = array[:, cols]
                    elif self.layout == "column":
                        new[name] = array[cols]
            node.outputs[0].shape = ir.Shape([self.k, len(cols)])
        removed = self.k * (self.n - len(cols))
        self._write(new, constant, hint)
        return removed

    def take_rows(self, rows: np.ndarray, constant: Constant) -> int:
        """Keep input rows ``rows`` (whole blocks of a blocked weight: ``removable_rows``); the elements removed."""
        rows = np.asarray(rows, np.int64)
        node, hint = self.node, self.node.name or "lz_quantized"
        if self.layout == "blocked":
            blocks = np.unique(rows // self.block)
            whole = np.concatenate([np.arange(b * self.block, min(self.k, (b + 1) * self.block)) for b in blocks])
            if not np.array_equal(whole, rows):
                raise ValueError(f"{hint}: rows that are not whole blocks of {self.block}")
        if self.form == "nbits":
            kb = -(-self.k // self.block)
            new = {"B": self.raw["B"][:, blocks]}
            new["scales"] = self._nbits_blocks(self.raw["scales"], blocks, kb)
            if "zero_points" in self.raw:
                new["zero_points"] = self._nbits_blocks(self.raw["zero_points"], blocks, kb)
            node.attributes["K"] = ir.AttrInt64("K", len(rows))
        else:
            new = {"x": self.raw["x"][rows]}
            for name in ("scale", "zero_point"):
                if name in self.raw:
                    array = self.raw[name]
                    if self.layout == "blocked":
                        new[name] = array[blocks]
                    elif self.layout == "row":
                        new[name] = array[rows]
            node.outputs[0].shape = ir.Shape([len(rows), self.n])
        removed = self.n * (self.k - len(rows))
        self._write(new, constant, hint)
        return removed

    def zeroed(self, constant: Constant) -> None:
        """Every scale 0: the weight dequantizes to zeros (the lattice folds its MatMul)."""
        name = "scales" if self.form == "nbits" else "scale"
        self._write({name: np.zeros_like(self.raw[name])}, constant, self.node.name or "lz_quantized")

    # the packed per-row arrays of MatMulNBits ---------------------------------------------------------
    def _nbits_rows(self, array: np.ndarray, cols: np.ndarray) -> np.ndarray:
        shaped = array.reshape(self.n, -1)[cols]
        return shaped if array.ndim == 2 else shaped.reshape(-1)

    def _nbits_blocks(self, array: np.ndarray, blocks: np.ndarray, kb: int) -> np.ndarray:
        shaped = array.reshape(self.n, -1)
        if array.dtype == np.uint8 and shaped.shape[1] != kb:  # packed zero points
            picked = _pack(_unpack(shaped, self.bits)[:, :kb][:, blocks], self.bits)
        else:
            picked = shaped[:, blocks]
        return picked if array.ndim == 2 else picked.reshape(-1)

    def _write(self, new: dict[str, np.ndarray], constant: Constant, hint: str) -> None:
        for name, array in new.items():
            index = _INPUTS[self.form].index(name)
            self.node.replace_input_with(index, constant(f"{hint}_{name}", np.ascontiguousarray(array)))
            self.raw[name] = array
        # the view now describes the rewritten weight
        fresh = quantized_weight(self.node)
        if fresh is not None:
            self.__dict__.update({f.name: getattr(fresh, f.name) for f in dataclasses.fields(self)})


def quantized_weight(node: ir.Node | None) -> QuantizedWeight | None:
    """The quantized weight ``node`` computes with (a MatMulNBits) or produces (a DequantizeLinear), or None when
    it is neither, or its inputs are no constants, or its form is one this module does not read."""
    if node is None:
        return None
    if is_matmul_nbits(node):
        return _nbits(node)
    if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"):
        return _dq(node)
    return None


ZERO_META_KEY = "layerzero.quantized_zero"


def is_zero_weight(node: ir.Node) -> bool:
    """Whether the quantized weight of ``node`` (``quantized_weight``) is all zero; cached on the node for its
    current inputs (the fixpoint's later iterations read nothing)."""
    key = tuple(id(v) for v in node.inputs)
    cached = node.meta.get(ZERO_META_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    weight = quantized_weight(node)
    zero = weight is not None and weight.all_zero()
    node.meta[ZERO_META_KEY] = (key, zero)
    return zero


def quantized_operand(value: ir.Value | None) -> QuantizedWeight | None:
    """The quantized weight a MatMul reads as ``value`` (the output of a DequantizeLinear of constants)."""
    if value is None or value.is_graph_output():
        return None
    return quantized_weight(value.producer())


def _nbits(node: ir.Node) -> QuantizedWeight | None:
    k, n, bits, block = (_attr(node, a) for a in ("K", "N", "bits", "block_size"))
    if None in (k, n, bits, block) or bits not in (2, 4, 8) or block < 16 or block * bits % 8:  # type: ignore[operator]
        return None
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        return None  # g_idx: a permuted K
    raw: dict[str, np.ndarray] = {}
    for i, name in enumerate(_INPUTS["nbits"]):
        if i == 0 or i == 4 or i >= len(node.inputs) or node.inputs[i] is None:
            continue
        array = const_array(node.inputs[i])
        if array is None:
            return None
        raw[name] = array
    if "B" not in raw or "scales" not in raw:
        return None
    kb = -(-k // block)  # type: ignore[operator]
    b = raw["B"]
    if b.dtype != np.uint8 or b.shape != (n, kb, block * bits // 8) or raw["scales"].size != n * kb:  # type: ignore[operator]
        return None
    scales = raw["scales"].reshape(n, kb).astype(np.float32).T  # type: ignore[arg-type]
    zp = raw.get("zero_points")
    if zp is None:
        zero_points = np.full((kb, n), 2 ** (bits - 1), np.float64)  # type: ignore[arg-type,operator]
    elif zp.dtype == np.uint8 and zp.size == n * -(-(kb * bits) // 8):  # type: ignore[operator]
        zero_points = _unpack(zp.reshape(n, -1), bits)[:, :kb].T.astype(np.float64)  # type: ignore[arg-type]
    elif zp.dtype.kind == "f" and zp.size == n * kb:  # type: ignore[operator]
        zero_points = zp.reshape(n, kb).astype(np.float64).T  # type: ignore[arg-type]
    else:
        return None
    if "bias" in raw and raw["bias"].size != n:
        return None
    out = node.outputs[0].dtype
    out_dtype = out.numpy() if out is not None else raw["scales"].dtype
    return QuantizedWeight(node, "nbits", k, n, bits, block, scales, zero_points, out_dtype, raw, "blocked")  # type: ignore[arg-type]


def _dq(node: ir.Node) -> QuantizedWeight | None:
    arrays = [const_array(v) if v is not None else None for v in node.inputs[:3]]
    x, scale = arrays[0], arrays[1] if len(arrays) > 1 else None
    zp = arrays[2] if len(arrays) > 2 else None
    if x is None or scale is None or x.ndim != 2 or str(x.dtype) not in _INT_KINDS or scale.dtype.kind != "f":
        return None
    if len(node.inputs) > 2 and node.inputs[2] is not None and zp is None:
        return None  # a run-time zero point
    k, n = x.shape
    axis = _attr(node, "axis", 1) % 2  # type: ignore[operator]
    block = _attr(node, "block_size", 0) or 0
    raw = {"x": x, "scale": scale, **({"zero_point": zp} if zp is not None else {})}
    z = np.zeros_like(scale, dtype=np.float64) if zp is None else zp.astype(np.float64)
    if scale.size == 1 and block == 0:
        layout, bs, s, z = "tensor", k, scale.reshape(1, 1), z.reshape(1, 1)
    elif block == 0 and scale.ndim == 1 and scale.shape[0] == x.shape[axis]:
        if axis == 1:
            layout, bs, s, z = "column", k, scale.reshape(1, n), z.reshape(1, n)
        else:
            layout, bs, s, z = "row", 1, scale.reshape(k, 1), z.reshape(k, 1)
    elif block > 0 and axis == 0 and scale.shape == (-(-k // block), n):
        layout, bs, s = "blocked", block, scale
    else:
        return None  # blocks along N, or a shape this reader does not know
    if z.shape != s.shape:
        return None
    bits = int(np.dtype(x.dtype).itemsize * 8) if str(x.dtype) not in ("int4", "uint4") else 4
    out = node.outputs[0].dtype
    out_dtype = out.numpy() if out is not None else scale.dtype
    return QuantizedWeight(node, "dq", k, n, bits, bs, s.astype(np.float32), z, out_dtype, raw, layout)
