"""liblayerzero_ort.so's quantized experts (``ai.layerzero::MoE`` with ``weight_format`` q8 / q4): the block format of
``plugins/quant.py`` (round trip, packing order, either axis), the row kernel alone against the numpy reference of
its arithmetic (k and row tails, every ISA), the op against ``moe_quant_reference`` for every routing variant the
float tests cover, against the float op on the dequantized weights within the quantization's own bound, token
counts at the kernel boundaries, an unaligned input, threads, the portable / AVX2 kernels, session-creation
refusals, and the AddressSanitizer build.

The library is built as in test_ort_native.py (``build/ort-test``, ``LAYERZERO_ORT_TEST_BUILD``; skips without
the ONNX Runtime headers or cmake unless ``LAYERZERO_REQUIRE_NATIVE=1``). Run as a script
(``python tests/plugins/test_ort_quant.py LIB [--quick] [--expect-isa ISA]``) it checks the matrix and the row
kernel against ``LIB`` and exits non-zero on a mismatch (the subprocess tests: other ISAs, ASan).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins.quant import (
    chunk_q4_rows,
    dequantize_blocks,
    moe_quant_reference,
    qdot_rows,
    quantize_activations,
    quantize_blocks,
    quantize_moe_weights,
    unpack_codes,
)
from layerzero.plugins.reference import moe_reference

if __name__ == "__main__":  # run as a script (above): tests.plugins imports from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.plugins import ort_moe
from tests.plugins.ort_moe import NODE, THRESHOLD, VARIANTS, session

# ort_lib / ort_lib_asan: tests/plugins/conftest.py (one build per session for every plugin test).


# ------------------------------------------------------------------------------------------------ the format


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis", [-1, -2])
def test_round_trip_within_half_a_step(bits, axis):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 64, 96)) * np.exp(rng.standard_normal((3, 64, 1)))).astype(np.float32)
    w[0, 0, :32] = 0.0  # a zero block (axis -1)
    codes, scales = quantize_blocks(w, bits, axis=axis)
    moved = np.moveaxis(w, axis, -1)
    k = moved.shape[-1]
    assert scales.dtype == np.float16 and scales.shape == (*moved.shape[:-1], k // 32)
    assert codes.dtype == (np.int8 if bits == 8 else np.uint8)
    assert codes.shape == (*moved.shape[:-1], k if bits == 8 else k // 2)
    assert codes.flags.c_contiguous and scales.flags.c_contiguous
    back = dequantize_blocks(codes, scales, bits, axis=axis)
    assert back.shape == w.shape and back.dtype == np.float32
    step = np.repeat(scales.astype(np.float32), 32, axis=-1)  # d of each element, block axis last
    err = np.abs(np.moveaxis(back, axis, -1) - moved)
    assert np.all(err <= step / 2 * (1 + 1e-3) + 1e-30)
    # the codes are symmetric: -qmax..qmax, the largest |w| of a block at a code of magnitude qmax
    q = unpack_codes(codes, bits).reshape(*moved.shape[:-1], k // 32, 32)
    qmax = 127 if bits == 8 else 7
    assert np.abs(q).max() == qmax and np.all(np.abs(q).max(axis=-1)[scales > 0] == qmax)
    if axis == -1:
        assert not back[0, 0, :32].any() and scales[0, 0, 0] == 0


def test_q4_nibble_order_and_offset():
    # Element 2j in the low nibble of byte j, element 2j + 1 in the high one, each stored as code + 8.
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 7.0, -7.0, 1.0, -3.0
    codes, scales = quantize_blocks(w, 4)
    assert scales[0, 0] == np.float16(1.0)
    assert codes.shape == (1, 16)
    assert codes[0, 0] == (7 + 8) | ((-7 + 8) << 4)
    assert codes[0, 1] == (1 + 8) | ((-3 + 8) << 4)
    assert np.all(codes[0, 2:] == 8 | (8 << 4))
    # every nibble decodes, 0 included (-8)
    assert dequantize_blocks(np.zeros((1, 16), np.uint8), scales, 4)[0, 0] == -8.0
    c8, s8 = quantize_blocks(w, 8)
    assert c8[0, :4].tolist() == [127, -127, 18, -54] and s8[0, 0] == np.float16(7.0 / 127)


def test_axis_moves_the_block_axis_last():
    # axis=-2 of an [out, in] matrix: blocks along the output dimension, one input channel per stored row (the
    # input-major layout activation-sparse kernels skip rows of): the same encoding as axis=-1 of the transpose.
    w = np.random.default_rng(1).standard_normal((2, 64, 40)).astype(np.float32)
    for bits in (8, 4):
        codes, scales = quantize_blocks(w, bits, axis=-2)
        ct, st = quantize_blocks(np.swapaxes(w, -1, -2), bits, axis=-1)
        assert codes.shape[:2] == (2, 40) and np.array_equal(codes, ct) and np.array_equal(scales, st)
        assert np.array_equal(
            dequantize_blocks(codes, scales, bits, axis=-2), np.swapaxes(dequantize_blocks(ct, st, bits), -1, -2)
        )
        c1, s1 = quantize_blocks(w, bits, axis=1)
        assert np.array_equal(c1, codes) and np.array_equal(s1, scales)


def test_format_refuses_what_it_cannot_encode():
    with pytest.raises(ValueError, match="not a multiple of the block length 32"):
        quantize_blocks(np.ones((4, 36), np.float32), 4)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_blocks(np.ones((4, 32), np.float32), 3)
    with pytest.raises(ValueError, match="float16"):
        quantize_blocks(np.full((1, 32), 1e9, np.float32), 4)


def test_activation_quantization():
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    x[1, :32] = 0.0
    q, d = quantize_activations(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and d.shape == (3, 2)
    assert d[1, 0] == 0 and not q[1, :32].any()
    assert np.all(np.abs(q.reshape(3, 2, 32)).max(axis=-1)[d > 0] == 127)
    err = np.abs(q.reshape(3, 2, 32) * d[..., None] - x.reshape(3, 2, 32))
    assert np.all(err <= d[..., None] / 2 * (1 + 1e-5))


# ------------------------------------------------------------------------------------------ the row kernel


def _qdot_fn(lib: Path):
    fn = ctypes.CDLL(str(lib)).LayerZeroOrtQDotRows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return fn


def check_rows(lib: Path) -> list[str]:
    """The row kernel against ``qdot_rows`` on every block count 1..20 (the vector steps of 2 / 4 blocks, the
    8- / 16-block scale chunks and their tails), more, and row counts around the 4-row step; q4 in both code
    layouts (``chunk16``: whole chunks from 16 blocks on, then the plain blocks after them)."""
    fn, failures, rng = _qdot_fn(lib), [], np.random.default_rng(3)
    for bits, layout in ((8, 0), (4, 0), (4, 1)):
        for nb in (*range(1, 21), 33, 47, 64):
            for rows in (1, 3, 4, 5, 9):
                for tokens in (1, 2):
                    k = nb * 32
                    w = rng.standard_normal((rows, k)).astype(np.float32)
                    codes, scales = quantize_blocks(w, bits)
                    stored = chunk_q4_rows(codes) if layout else codes
                    x = rng.standard_normal((tokens, k)).astype(np.float32)
                    out = np.full((tokens, rows), np.nan, np.float32)
                    rc = fn(
                        stored.ctypes.data,
                        scales.ctypes.data,
                        rows,
                        k,
                        bits,
                        layout,
                        x.ctypes.data,
                        tokens,
                        out.ctypes.data,
                    )
                    ref = qdot_rows(codes, scales, bits, x)
                    scale = qdot_rows(codes, scales, bits, x, absolute=True)  # Σ|terms|: float rounding's scale
                    err = float((np.abs(out - ref) / scale).max())
                    if rc != 0 or not err <= 1e-5:
                        failures.append(
                            f"rows: q{bits} layout {layout} k={k} rows={rows} T={tokens}: rc={rc} error {err:.2e}"
                        )
    return failures


def _quantize_fn(lib: Path):
    fn = ctypes.CDLL(str(lib)).LayerZeroOrtQuantizeToken
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def _special_token(rng: np.random.Generator) -> np.ndarray:
    """x [32 * 12]: ordinary blocks and the quantizer's edge cases, one per block."""
    blocks = [rng.standard_normal(32).astype(np.float32) for _ in range(4)]
    blocks.append(np.zeros(32, np.float32))  # max 0: every code 0
    blocks.append(np.concatenate([[127.0], np.arange(-62, 62, 4) + 0.5]).astype(np.float32)[:32])  # ties: inv = 1
    blocks.append(np.arange(-16, 16, dtype=np.float32) + 0.5)
    nan = rng.standard_normal(32).astype(np.float32)
    nan[5] = np.nan
    blocks.append(nan)
    inf = rng.standard_normal(32).astype(np.float32)
    inf[9] = -np.inf
    blocks.append(inf)
    blocks.append((rng.standard_normal(32) * 1e38).astype(np.float32))  # near float's maximum
    tiny = (rng.standard_normal(32) * 1e-40).astype(np.float32)  # subnormals: 127 / max overflows to inf
    tiny[3] = 0.0  # 0 * inf
    blocks.append(tiny)
    blocks.append(np.full(32, -3.0, np.float32))
    return np.concatenate(blocks)


@pytest.mark.parametrize(("bits", "layout"), [(8, 0), (4, 0), (4, 1)])
def test_token_quantizer_vector_equals_portable_and_numpy(ort_lib, bits, layout):
    """The vector quantizer (AVX-512 where the CPU has it) writes bitwise the portable one's codes, scales and
    offsets, ties rounded half to even, zero / NaN / infinite blocks all-zero codes; finite blocks as numpy."""
    fn, rng = _quantize_fn(ort_lib), np.random.default_rng(11)
    for _ in range(4):
        x = _special_token(rng)
        if layout:  # 16 blocks in a whole chunk, then the rest
            x = np.concatenate([x, _special_token(rng)])
        k, nb = x.size, x.size // 32
        got = []
        for portable in (0, 1):
            q, d, off = np.zeros(k, np.int8), np.zeros(nb, np.float32), np.zeros(nb, np.int32)
            assert fn(x.ctypes.data, k, bits, layout, portable, q.ctypes.data, d.ctypes.data, off.ctypes.data) == 0
            got.append((q, d, off))
        (q, d, off), (qp, dp, offp) = got
        assert np.array_equal(q, qp) and np.array_equal(off, offp)
        assert np.array_equal(d.view(np.int32), dp.view(np.int32))  # NaN scales bitwise too
        xb = x.reshape(nb, 32)
        amax = np.abs(xb).max(axis=1)
        finite = np.isfinite(xb).all(axis=1) & ((amax == 0) | (amax > 1e-36))  # numpy's int8 cast of NaN: undefined
        with np.errstate(invalid="ignore", over="ignore"):
            ref_q, ref_d = quantize_activations(x)
        rq = ref_q.reshape(nb, 32)
        assert np.array_equal(q.reshape(nb, 32)[finite], rq[finite])
        assert np.array_equal(d[finite], ref_d[finite])
        assert not q.reshape(nb, 32)[~np.isfinite(xb).all(axis=1)].any()
        assert q.reshape(nb, 32)[10, 3] == 0 and np.abs(q.reshape(nb, 32)[10]).max() == 127  # the tiny block
        offset = 8 if bits == 4 else 128
        assert np.array_equal(off, -offset * q.reshape(nb, 32).astype(np.int32).sum(axis=1))
    assert np.array_equal(q.reshape(nb, 32)[5], np.rint(x[160:192]).astype(np.int8))  # ties to even


def test_row_kernel_matches_its_numpy_arithmetic(ort_lib):
    failures = check_rows(ort_lib)
    assert not failures, "\n".join(failures[:20])


# ------------------------------------------------------------------------------------------------- the op


def _float_weights(experts: int, ffn: int, hidden: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((experts, ffn, hidden)) / np.sqrt(hidden)).astype(np.float32),
        (rng.standard_normal((experts, ffn, hidden)) / np.sqrt(hidden)).astype(np.float32),
        (rng.standard_normal((experts, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32),
    ]


def quant_model(
    experts: int = 8,
    ffn: int = 64,
    hidden: int = 96,
    bits: int = 4,
    *,
    seed: int = 0,
    htype: str = "float32",
    biases: bool = False,
    score_bias: np.ndarray | None = None,
    threshold_input: bool = False,
    inputs: int | None = None,
    scale_dtype: str = "float16",
    **attrs: object,
) -> tuple[onnx.ModelProto, dict]:
    """One quantized ``ai.layerzero::MoE`` node over initializers; what the references need."""
    w = _float_weights(experts, ffn, hidden, seed)
    codes, scales = quantize_moe_weights(*w, bits)
    rng = np.random.default_rng(seed + 100)
    extra: dict = {"codes": codes, "scales": scales, "bits": bits, "float": w}
    stored = [chunk_q4_rows(c) for c in codes] if attrs.get("code_layout") == "chunk16" and bits == 4 else codes
    inits = [numpy_helper.from_array(a, n) for a, n in zip(stored, ("cg", "cu", "cd"))]
    inits += [numpy_helper.from_array(s.astype(scale_dtype), n) for s, n in zip(scales, ("sg", "su", "sd"))]
    names = ["hidden", "logits", "cg", "cu", "cd", "", "", "", "", ""]
    if biases:
        for i, (key, shape) in enumerate(
            (("b_gate", (experts, ffn)), ("b_up", (experts, ffn)), ("b_down", (experts, hidden)))
        ):
            extra[key] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
            inits.append(numpy_helper.from_array(extra[key], key))
            names[5 + i] = key
    if score_bias is not None:
        inits.append(numpy_helper.from_array(score_bias.astype(np.float32), "score_bias"))
        names[8] = "score_bias"
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(htype))
    graph_inputs = [
        helper.make_tensor_value_info("hidden", elem, ["T", hidden]),
        helper.make_tensor_value_info("logits", elem, ["T", experts]),
    ]
    if threshold_input:
        graph_inputs.append(helper.make_tensor_value_info(THRESHOLD, TensorProto.FLOAT, []))
        names[9] = THRESHOLD
    names += ["sg", "su", "sd"]
    if inputs is not None:
        names = names[:inputs]
    attrs = dict(dict(weight_format=f"q{bits}"), **attrs)
    return ort_moe.moe_node_model(names, graph_inputs, elem, experts, hidden, inits, **attrs), extra


_ROUTING_KEYS = ("top_k", "normalize", "scoring", "zeroing_threshold", "n_group", "topk_group", "routed_scaling_factor")


def reference(extra: dict, x: np.ndarray, logits: np.ndarray, attrs: dict, threshold: float | None = None, **more):
    routing = {k: v for k, v in attrs.items() if k in _ROUTING_KEYS}
    if threshold is not None:
        routing["zeroing_threshold"] = threshold
    act = {k: v for k, v in attrs.items() if k in ("activation", "activation_alpha", "activation_limit")}
    biases = {k: extra[k] for k in ("b_gate", "b_up", "b_down") if k in extra}
    return moe_quant_reference(
        x, logits, extra["codes"], extra["scales"], extra["bits"], **biases, **act, **routing, **more
    )


def _mismatch(y: np.ndarray, mask: np.ndarray, ref: np.ndarray, ref_mask: np.ndarray, slack: np.ndarray) -> str | None:
    """None when y matches the quantized reference: float-summation tolerance (1e-5 of the largest |y|) plus
    the bound of h elements that sit on a rounding boundary (moe_quant_reference's h_slack)."""
    if y.shape != ref.shape or mask.shape != ref_mask.shape:
        return f"shapes {y.shape} {mask.shape}"
    if not np.array_equal(mask, ref_mask):
        return "mask differs"
    if y.size == 0:
        return None
    scale = max(float(np.abs(ref).max()), 1e-30)
    excess = np.abs(y.astype(np.float64) - ref.astype(np.float64)) - slack
    worst = float(excess.max()) / scale
    return None if worst <= 1e-5 else f"relative error {worst:.2e} beyond the h-rounding slack"


# Shapes with a group tail (H 1056 = 33 blocks: not a whole 4-block group nor 16-block chunk), short rows
# (F 32: one block), experts no token uses (16 experts top-2 on a few tokens).
SHAPES = [(8, 64, 96), (16, 32, 1056)]
# The v2 routing and expert variants of test_ort_native.py (score_bias, groups, DeepSeek-V3, scaling, biases,
# swiglu_oai clamped / unclamped).
V2 = [
    dict(score_bias=True, scoring="sigmoid", normalize=1, top_k=4),
    dict(n_group=4, topk_group=2, scoring="sigmoid", normalize=1, top_k=4),
    dict(score_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, scoring="sigmoid", normalize=1, top_k=4),
    dict(routed_scaling_factor=0.5, top_k=2, normalize=1),
    dict(score_bias=True, n_group=4, topk_group=2, scoring="softmax", normalize=0, top_k=4),
    dict(biases=True, activation="silu", top_k=2, normalize=1),
    dict(biases=True, activation="swiglu_oai", top_k=2, normalize=1),
    dict(activation="swiglu_oai", activation_alpha=1.5, activation_limit=0.8, top_k=2, normalize=1),
    dict(biases=True, activation="swiglu_oai", activation_limit=float("inf"), top_k=2, normalize=1),
]


def check_matrix(lib: Path, quick: bool = False) -> list[str]:
    """Mismatches of the op against moe_quant_reference (empty when it agrees everywhere)."""
    failures = []
    rng = np.random.default_rng(1)
    variants = VARIANTS[::5] if quick else VARIANTS
    # q4 also in code_layout chunk16, with a shape whose w_down rows (F 544) and w_gate / w_up rows (H 1056) have
    # whole chunks and blocks after them.
    for bits, layout in ((4, "rows"), (8, "rows"), (4, "chunk16")):
        shapes = [*SHAPES, (8, 544, 1056)] if layout == "chunk16" else SHAPES
        for experts, ffn, hidden in shapes:
            for variant in variants[::3] if layout == "chunk16" else variants:
                for threshold in (0.0, 0.4):
                    model, extra = quant_model(
                        experts, ffn, hidden, bits, zeroing_threshold=threshold, code_layout=layout, **variant
                    )
                    sess = session(lib, model)
                    for tokens in (0, 1, 3, 37):
                        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
                        logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
                        y, mask = sess.run(None, {"hidden": x, "logits": logits})
                        ref, ref_mask, slack = reference(extra, x, logits, dict(variant, zeroing_threshold=threshold))
                        if (bad := _mismatch(y, mask, ref, ref_mask, slack)) is not None:
                            failures.append(
                                f"q{bits} {layout} E{experts} F{ffn} H{hidden} {variant} thr={threshold} T={tokens}: "
                                f"{bad}"
                            )
        for variant in V2[::3] if quick or layout == "chunk16" else V2:
            variant = dict(variant)
            experts, ffn, hidden = (16, 544, 1056) if layout == "chunk16" else (16, 64, 96)
            bias = (rng.standard_normal(experts) * 0.3).astype(np.float32) if variant.pop("score_bias", False) else None
            model, extra = quant_model(
                experts, ffn, hidden, bits, score_bias=bias, threshold_input=True, code_layout=layout, **variant
            )
            sess = session(lib, model)
            for threshold in (0.0, 0.3):
                for tokens in (0, 1, 37):
                    x = (rng.standard_normal((tokens, hidden)) * 3).astype(np.float32)  # reaches swiglu's clamp
                    logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
                    feeds = {"hidden": x, "logits": logits, THRESHOLD: np.array(threshold, np.float32)}
                    y, mask = sess.run(None, feeds)
                    attrs = {k: v for k, v in variant.items() if k != "biases"}
                    ref, ref_mask, slack = reference(extra, x, logits, attrs, threshold, score_bias=bias)
                    if (bad := _mismatch(y, mask, ref, ref_mask, slack)) is not None:
                        failures.append(f"q{bits} {layout} v2 {variant} thr={threshold} T={tokens}: {bad}")
    return failures


def test_matches_reference_every_variant(ort_lib):
    failures = check_matrix(ort_lib)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("bits", [8, 4])
def test_against_the_float_op_on_the_dequantized_weights(ort_lib, bits):
    # The float op on dequantize_blocks(codes, scales) with an x already on its 32-block grid: the quantized op
    # then differs only by its int8 rounding of h, at most half a step of h's block per element, i.e.
    # |Δy| <= Σ_e w_e Σ_j (d_h(j) / 2) |w_down[e][:, j]| (+ float tolerance). With x off the grid, the two
    # stay within a few % (the activations' own 8-bit rounding).
    experts, ffn, hidden = 8, 64, 96
    attrs = dict(top_k=2, normalize=1)
    model, extra = quant_model(experts, ffn, hidden, bits, **attrs)
    deq = [dequantize_blocks(c, s, bits) for c, s in zip(extra["codes"], extra["scales"])]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, hidden)).astype(np.float32)
    q, d = quantize_activations(x)
    x_grid = (q.reshape(37, -1, 32) * d[..., None]).reshape(37, hidden).astype(np.float32)
    logits = rng.standard_normal((37, experts)).astype(np.float32) * 2
    sess = session(ort_lib, model)
    for inputs, limit in ((x_grid, None), (x, 0.05)):
        y, mask = sess.run(None, {"hidden": inputs, "logits": logits})
        ref, ref_mask = moe_reference(inputs, logits, *deq, **attrs)
        assert np.array_equal(mask, ref_mask)
        err = np.abs(y.astype(np.float64) - ref)
        if limit is not None:
            assert err.max() / np.abs(ref).max() < limit
            continue
        from layerzero.plugins.reference import glu, moe_routing

        dense, _ = moe_routing(logits, **attrs)
        bound = np.zeros_like(err)
        for e in range(experts):
            rows = np.flatnonzero(mask[:, e])
            if rows.size:
                h = glu(
                    inputs[rows] @ deq[0][e].T.astype(np.float64), inputs[rows] @ deq[1][e].T.astype(np.float64), "silu"
                )
                step = np.repeat(np.abs(h.reshape(len(rows), -1, 32)).max(axis=-1) / 127, 32, axis=-1)
                bound[rows] += dense[rows, e, None] * ((step / 2) @ np.abs(deq[2][e]).T)
        assert np.all(err <= bound * (1 + 1e-3) + 1e-5 * np.abs(ref).max())
        assert err.max() > 0  # h's rounding is there (else this test proves nothing)


def test_float16_hidden(ort_lib):
    model, extra = quant_model(8, 64, 96, 4, htype="float16", top_k=2, normalize=1)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 96)).astype(np.float16)
    logits = rng.standard_normal((5, 8)).astype(np.float16)
    y, mask = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})
    assert y.dtype == np.float16
    ref, ref_mask, slack = reference(extra, x.astype(np.float32), logits.astype(np.float32), dict(top_k=2, normalize=1))
    assert np.array_equal(mask, ref_mask)
    assert np.abs(y.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max() + slack.max()  # fp16 output


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 4), (64, 4)])
@pytest.mark.parametrize("bits", [8, 4])
def test_threads_do_not_change_the_result(ort_lib, tokens, top_k, bits):
    # One token, top-1: its expert's F 224 is split into pieces of whole blocks (h quantized per piece) and H 160
    # into row pieces as the threads need items; bitwise equal at 1 and 2 threads.
    model, _ = quant_model(16, 224, 160, bits, top_k=top_k, normalize=1)
    feeds = ort_moe.random_feeds(np.random.default_rng(7), tokens, 160, 16)
    assert ort_moe.same_at_one_and_two_threads(ort_lib, model, feeds)


@pytest.mark.parametrize("bits", [8, 4])
def test_token_counts_at_kernel_boundaries(ort_lib, bits):
    # As test_ort_native.py: tokens 1..9, 15, 16, 17 per expert (top_k = E: every token in place; top-2 of 8:
    # gathered), and the input at an address 4 bytes past a 32-byte boundary: bitwise the same result.
    rng = np.random.default_rng(11)
    for experts, top_k in ((4, 4), (8, 2)):
        model, extra = quant_model(experts, 64, 96, bits, top_k=top_k, normalize=1)
        sess = session(ort_lib, model)
        for tokens in (*range(1, 10), 15, 16, 17):
            x = rng.standard_normal((tokens, 96)).astype(np.float32)
            logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
            ref, ref_mask, slack = reference(extra, x, logits, dict(top_k=top_k, normalize=1))
            y, mask, y_shifted = ort_moe.run_aligned_and_unaligned(sess, x, logits)
            where = f"q{bits} E{experts} top_k={top_k} T={tokens}"
            assert _mismatch(y, mask, ref, ref_mask, slack) is None, where
            assert np.array_equal(y, y_shifted), where


def test_threshold_input_overrides_the_attribute(ort_lib):
    model, extra = quant_model(8, 64, 96, 4, top_k=4, normalize=1, threshold_input=True)
    sess = session(ort_lib, model)
    x, logits = ort_moe.random_feeds(np.random.default_rng(4), 9, 96, 8, logit_scale=2).values()
    counts = []
    for threshold, y, mask in ort_moe.threshold_runs(sess, x, logits):
        ref, ref_mask, slack = reference(extra, x, logits, dict(top_k=4, normalize=1), threshold)
        assert _mismatch(y, mask, ref, ref_mask, slack) is None
        counts.append(int(mask.sum()))
    assert counts[0] == 36 and counts[0] > counts[1] > counts[2] >= 9


def _cpu_flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


@pytest.mark.parametrize(("isa", "prefetch"), [("generic", ""), ("avx2", "1"), ("avx2", "0"), ("", "1"), ("", "0")])
def test_other_kernels_match_reference(ort_lib, isa, prefetch):
    # LAYERZERO_ORT_ISA=generic: the portable build; =avx2: the AVX2 build on a CPU that has AVX-512 VNNI; each
    # vector build with and without its rows' software prefetch (LAYERZERO_ORT_PREFETCH: one is this CPU's default).
    if isa == "avx2" and " avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if isa == "" and " avx512_vnni" not in _cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI (the best kernels are the AVX2 build's, run above)")
    args = ["--expect-isa", isa or "avx512vnni"]
    proc = subprocess.run(
        [sys.executable, __file__, str(ort_lib), "--quick", *args],
        capture_output=True,
        text=True,
        env=ort_moe.script_env(LAYERZERO_ORT_ISA=isa, LAYERZERO_ORT_PREFETCH=prefetch),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("forced", ["", "0", "1"])
def test_the_prefetch_choice(ort_lib, forced):
    """The rows' software prefetch: off for the AVX2 build on AMD CPUs (it cost 10-40 % on a Zen 3 host), on
    elsewhere, and LAYERZERO_ORT_PREFETCH forces it (the generic kernels have none)."""
    flags = _cpu_flags()
    vector = " avx2" in flags and " f16c" in flags and " fma" in flags
    vnni = " avx512_vnni" in flags
    script = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).LayerZeroOrtQuantPrefetch())"
    out = subprocess.run(
        [sys.executable, "-c", script, str(ort_lib)],
        capture_output=True,
        text=True,
        check=True,
        env=ort_moe.script_env(LAYERZERO_ORT_PREFETCH=forced),
        timeout=120,
    ).stdout.strip()
    want = (forced == "1") if forced else (vnni or "AuthenticAMD" not in flags)
    assert out == str(int(want and vector)), (forced, out)


def test_best_and_portable_kernels_agree(ort_lib, tmp_path):
    # The same model and inputs on the best ISA and on the portable kernels: close (float summation order only).
    model, _ = quant_model(16, 64, 1056, 4, top_k=4, normalize=1)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(9)
    np.savez(
        tmp_path / "in.npz",
        hidden=rng.standard_normal((7, 1056)).astype(np.float32),
        logits=rng.standard_normal((7, 16)).astype(np.float32),
    )
    script = (
        "import sys, numpy as np, onnxruntime as ort\n"
        "o = ort.SessionOptions(); o.register_custom_ops_library(sys.argv[1])\n"
        "s = ort.InferenceSession(sys.argv[2], o, providers=['CPUExecutionProvider'])\n"
        "f = dict(np.load(sys.argv[3])); np.save(sys.argv[4], s.run(None, f)[0])\n"
    )
    outs = {}
    for isa in ("", "generic"):
        out = tmp_path / f"y{isa}.npy"
        subprocess.run(
            [sys.executable, "-c", script, str(ort_lib), str(path), str(tmp_path / "in.npz"), str(out)],
            check=True,
            env=ort_moe.script_env(LAYERZERO_ORT_ISA=isa),
            timeout=300,
        )
        outs[isa] = np.load(out)
    assert np.abs(outs[""] - outs["generic"]).max() <= 1e-5 * np.abs(outs["generic"]).max()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(weight_format="q3"), "weight_format='q3' is not implemented"),
        (dict(block_size=64), "block_size=64 is not implemented"),
        (dict(hidden=80), "w_gate's rows have 80 elements, not a multiple of the block length 32"),
        (dict(ffn=40), "w_down's rows have 40 elements, not a multiple of the block length 32"),
        (dict(inputs=10), "needs 13 inputs"),
        (dict(scale_dtype="float32"), "s_gate must be float16"),
        (dict(weight_format="f"), "input size 13"),
        (dict(weight_format="q8"), "codes are int8"),  # q4's uint8 codes under q8
        (dict(activation="tanh"), "activation='tanh' is not implemented"),
        (dict(code_layout="tiles"), "code_layout='tiles' is not implemented"),
        (dict(weight_format="q8", code_layout="chunk16"), "code_layout='chunk16' is a q4 layout, not one of"),
    ],
)
def test_session_creation_refuses(ort_lib, kwargs, message):
    kwargs = dict(kwargs)
    shape = dict(hidden=kwargs.pop("hidden", 96), ffn=kwargs.pop("ffn", 64))
    if shape["hidden"] % 32 or shape["ffn"] % 32:
        model = _unaligned_model(**shape)
    else:
        model, _ = quant_model(8, shape["ffn"], shape["hidden"], 4, top_k=2, **kwargs)
    with pytest.raises(Exception) as info:
        session(ort_lib, model)
    text = str(info.value)
    assert message in text and NODE in text, text
    assert "\n" not in text.split(NODE, 1)[1].strip()


def _unaligned_model(hidden: int, ffn: int) -> onnx.ModelProto:
    """A q4 node whose H or F is not a multiple of 32 (codes built by hand: the format itself refuses them)."""
    experts = 8
    model, _ = quant_model(experts, 64, 96, 4, top_k=2)
    shapes = {
        "cg": (experts, ffn, hidden // 2),
        "cu": (experts, ffn, hidden // 2),
        "cd": (experts, hidden, ffn // 2),
        "sg": (experts, ffn, max(hidden // 32, 1)),
        "su": (experts, ffn, max(hidden // 32, 1)),
        "sd": (experts, hidden, max(ffn // 32, 1)),
    }
    del model.graph.initializer[:]
    for name, shape in shapes.items():
        dtype = np.uint8 if name.startswith("c") else np.float16
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(shape, dtype), name))
    for vi in (*model.graph.input, *model.graph.output):
        if vi.name in ("hidden", "y"):
            vi.type.tensor_type.shape.dim[1].dim_value = hidden
    return model


def test_scales_fed_at_run_time(ort_lib):
    # Scales that are graph inputs, not initializers: read (and checked) when the node runs.
    model, extra = quant_model(8, 64, 96, 4, top_k=2, normalize=1)
    graph = model.graph
    scales = {}
    for init in list(graph.initializer):
        if init.name in ("sg", "su", "sd"):
            scales[init.name] = numpy_helper.to_array(init)
            graph.initializer.remove(init)
            graph.input.append(helper.make_tensor_value_info(init.name, TensorProto.FLOAT16, list(init.dims)))
    sess = session(ort_lib, model)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    y, mask = sess.run(None, {"hidden": x, "logits": logits, **scales})
    ref, ref_mask, slack = reference(extra, x, logits, dict(top_k=2, normalize=1))
    assert _mismatch(y, mask, ref, ref_mask, slack) is None
    graph.input[-1].type.tensor_type.shape.dim[2].dim_value = 3
    bad = dict(scales, sd=np.ones((8, 96, 3), np.float16))
    with pytest.raises(Exception) as info:
        session(ort_lib, model).run(None, {"hidden": x, "logits": logits, **bad})
    assert "s_down must be [8, 96, 2]" in str(info.value) and NODE in str(info.value)


def test_codes_are_not_copied(ort_lib, tmp_path):
    # A 25 MB q8 model from a file with external data: the session's peak RSS stays within weights + 10 %.
    model, _ = quant_model(32, 512, 512, 8, top_k=2, normalize=1)
    grown, weights = ort_moe.peak_rss_growth(ort_lib, model, tmp_path)
    assert grown <= 1.1 * weights, f"peak RSS grew {grown / 1e6:.1f} MB for {weights / 1e6:.1f} MB of codes"


def test_address_sanitizer(ort_lib_asan):
    proc = ort_moe.run_under_asan(__file__, ort_lib_asan, "--quick")
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _check(lib: Path, quick: bool) -> list[str]:
    return check_rows(lib) + check_matrix(lib, quick=quick)


def _main(argv: list[str]) -> int:
    return ort_moe.script_main(argv, "LayerZeroOrtQuantIsa", "quantized kernels", _check)


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
