"""liblayerzero_ort.so's ``ai.layerzero::SparseLinear`` (issue 23's fused threshold + row-skip linear) against the
numpy reference ``plugins/sparse.py``: every weight format (f32 / f16 / bf16, q8, q4) × token counts 0, 1, 3, 9, 17
(decode and the grouped path) × unaligned K and N (f; q8 / q4: K, N multiples of 32, N with a 32-column tail) ×
thresholds 0 (= the dense product; q8 / q4: of the same codes and int8 x), per-channel and scalar thresholds, the
run-time scale absent / 0.5 / 0, bias, NaN in x; q8 / q4 edges (every row skipped, none skipped, blocks keeping
1, 2, 3, 5 rows: groups of 4 padded, unaligned x); the kept counts exactly, y within float32 rounding (f) or
bitwise (q8 / q4: the reference is the kernels' integer arithmetic); bitwise equal across intra-op thread
counts, column splits and token groupings; the portable and AVX2 kernels against the reference and the best one;
session-creation refusals (one line naming the node); the AddressSanitizer build.

The library is built as the other native tests build it (``build/ort-test``, tests/plugins/native_build.py; skips
without the ONNX Runtime headers or cmake unless ``LAYERZERO_REQUIRE_NATIVE=1``). Run as a script
(``python tests/plugins/test_sparse_linear.py LIB [--quick] [--expect-isa ISA]``) it checks the matrix against
``LIB`` and exits non-zero on a mismatch (the subprocess tests: other ISAs, column splits, ASan).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.contract import SPARSE_LINEAR_CODE_LAYOUT
from layerzero.plugins.quant import K_TILE, k_block_codes, quantize_activations, quantize_k_blocks
from layerzero.plugins.sparse import bf16_bits, dense_weight, sparse_linear_reference

REQUIRE = os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1"
NODE = "layers.0.mlp.down_proj/SparseLinear"
TOL = 1e-5  # |y - reference| <= TOL * Σ|x_i W[i, n]| over the kept i (float32 rounding of the sum)


def _absent(reason: str):
    if REQUIRE:
        pytest.fail(f"LAYERZERO_REQUIRE_NATIVE=1: {reason}")
    pytest.skip(reason)


# ort_lib / ort_lib_asan: tests/plugins/conftest.py (one build per session for every plugin test).


def weights(k: int, n: int, fmt: str, wtype: str = "float32", seed: int = 0):
    """``(w, w_scales, B float32)``: the op's weight input for ``fmt`` (``wtype`` for "f") and the float matrix."""
    b = (np.random.default_rng(seed).standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    if fmt == "f":
        if wtype == "float16":
            return b.astype(np.float16), None, b
        if wtype == "bfloat16":
            return bf16_bits(b), None, b
        return b, None, b
    codes, scales = quantize_k_blocks(b, 8 if fmt == "q8" else 4)
    return codes, scales, b


def quantized_dense(x: np.ndarray, w: np.ndarray, ws: np.ndarray, fmt: str) -> np.ndarray:
    """The dense product of q8 / q4 codes with x int8-rounded per 32-channel block (plugins/quant.py's MoE
    quantizer, not the reference's), in float64: what thresholds 0 must give."""
    q, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    codes = k_block_codes(w, 8 if fmt == "q8" else 4).astype(np.int64)
    k, n = codes.shape
    isum = np.einsum("tbj,bjn->tbn", q.reshape(-1, k // 32, 32).astype(np.int64), codes.reshape(k // 32, 32, n))
    y = (isum * ws.astype(np.float64)[None] * d.astype(np.float64)[..., None]).sum(axis=1)
    return y.reshape(*x.shape[:-1], n)


def _tensor(name: str, a: np.ndarray, bf16: bool = False) -> onnx.TensorProto:
    if bf16:
        return helper.make_tensor(name, TensorProto.BFLOAT16, a.shape, np.ascontiguousarray(a).tobytes(), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(a), name)


def sparse_model(
    w: np.ndarray,
    thresholds: np.ndarray,
    *,
    fmt: str = "f",
    w_scales: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    scale_input: bool = False,
    bf16: bool = False,
    lead: tuple = ("T",),
    x_k: int | None = None,
    **attrs: object,
) -> onnx.ModelProto:
    """One ``ai.layerzero::SparseLinear`` node over initializers (x and the optional scale are graph inputs)."""
    k = w.shape[0]
    n = w.shape[1] * (2 if fmt == "q4" else 1)
    inits = [_tensor("w", w, bf16), numpy_helper.from_array(np.asarray(thresholds), "thr")]
    ins = ["x", "w", "thr", "scale" if scale_input else "", "bias" if bias is not None else ""]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
    if w_scales is not None:
        inits.append(numpy_helper.from_array(w_scales, "ws"))
        ins.append("ws")
    while ins[-1] == "":
        ins.pop()
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, x_k or k])]
    if scale_input:
        graph_inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, []))
    if fmt != "f":
        attrs = {"code_layout": SPARSE_LINEAR_CODE_LAYOUT, **attrs}
    node = helper.make_node(
        "SparseLinear", ins, ["y", "kept"], domain="ai.layerzero", name=NODE, weight_format=fmt, path=NODE, **attrs
    )
    graph = helper.make_graph(
        [node],
        "g",
        graph_inputs,
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, n]),
            helper.make_tensor_value_info("kept", TensorProto.INT64, list(lead)),
        ],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.layerzero", 1)], ir_version=9
    )


def session(lib: Path, model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])


def activations(t: int, k: int, seed: int) -> np.ndarray:
    """Heavy-tailed x (Laplace-like magnitudes), a few exact zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.laplace(size=(t, k)) * np.exp(0.5 * rng.standard_normal((1, k)))).astype(np.float32)
    x[rng.random((t, k)) < 0.05] = 0.0
    return x


def _mismatch(y, kept, ref, ref_kept, absref, exact: bool = False) -> str | None:
    if y.shape != ref.shape or kept.shape != ref_kept.shape:
        return f"shapes y {y.shape} kept {kept.shape}, expected {ref.shape} {ref_kept.shape}"
    if kept.dtype != np.int64 or not np.array_equal(kept, ref_kept):
        return f"kept {kept.ravel()[:8]} != {ref_kept.ravel()[:8]}"
    if not np.array_equal(np.isnan(y), np.isnan(ref)):
        return "NaN positions differ"
    fin = ~np.isnan(ref)
    if exact:
        if not np.array_equal(y[fin], ref[fin]):
            return f"not bitwise the reference: max error {np.abs(y[fin] - ref[fin]).max():.3e}"
        return None
    err = np.abs(y[fin] - ref[fin]) - TOL * absref[fin] - 1e-30
    if err.size and err.max() > 0:
        return f"max error {np.abs(y[fin] - ref[fin]).max():.3e} beyond {TOL} x Σ|terms|"
    return None


def _absolute(x, w, w_scales, fmt, bf16, thr, scale):
    """Σ |x_i W[i, :]| over the kept i (the scale of the float32 rounding)."""
    W = np.abs(dense_weight(w, w_scales, fmt, bf16)).astype(np.float64)
    xt = x.reshape(-1, x.shape[-1])
    lim = np.broadcast_to(np.asarray(thr, np.float32), (x.shape[-1],)) * np.float32(1.0 if scale is None else scale)
    keep = ~(np.abs(xt) <= lim)
    a = np.where(keep, np.nan_to_num(np.abs(xt)), 0.0) @ W
    return a.reshape(*x.shape[:-1], W.shape[1])


LAYOUT = SPARSE_LINEAR_CODE_LAYOUT  # the stored q8 / q4 layout this library reads

CASES = [  # (fmt, weight type, K, N)
    ("f", "float32", 67, 131),
    ("f", "float32", 300, 193),
    ("f", "float16", 67, 131),
    ("f", "bfloat16", 67, 131),
    ("q8", "int8", 96, 160),
    ("q8", "int8", 320, 96),
    ("q4", "uint8", 96, 160),
    ("q4", "uint8", 320, 96),
    ("q4", "uint8", 64, 2 * K_TILE + 160),  # three column tiles of the stored codes, the last narrower
    ("q8", "int8", 64, K_TILE + 96),
]


def check_matrix(lib: Path, quick: bool = False) -> list[str]:
    """Every case against the reference; the failures, one line each."""
    failures = []
    cases = CASES[::2] if quick else CASES
    for ci, (fmt, wtype, k, n) in enumerate(cases):
        bf16 = wtype == "bfloat16"
        w, ws, _ = weights(k, n, fmt, wtype, seed=ci)
        rng = np.random.default_rng(100 + ci)
        per_channel = (np.abs(rng.laplace(size=k)) * 0.8).astype(np.float32)
        for thr_name, thr in (
            ("zero", np.zeros(k, np.float32)),
            ("channel", per_channel),
            ("scalar", np.array(0.7, np.float32)),
        ):
            for with_bias in (False, True):
                bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
                for scale in (None, 0.5, 0.0):
                    model = sparse_model(
                        w, thr, fmt=fmt, w_scales=ws, bias=bias, scale_input=scale is not None, bf16=bf16
                    )
                    sess = session(lib, model)
                    for t in (0, 1, 3, 9, 17):
                        x = activations(t, k, seed=t + 7 * ci)
                        if t == 3:
                            x[1, k // 2] = np.nan
                        feed = {"x": x}
                        if scale is not None:
                            feed["scale"] = np.array(scale, np.float32)
                        y, kept = sess.run(None, feed)
                        ref, ref_kept = sparse_linear_reference(x, w, thr, scale, bias, ws, fmt, bf16)
                        absref = _absolute(x, w, ws, fmt, bf16, thr, scale)
                        what = _mismatch(y, kept, ref, ref_kept, absref, exact=fmt != "f")
                        if what is None and (thr_name == "zero" or scale == 0.0) and t != 3:
                            if fmt == "f":
                                dense = x @ dense_weight(w, ws, fmt, bf16)
                            else:
                                dense = quantized_dense(x, w, ws, fmt)
                            dense = dense + (0 if bias is None else bias)
                            if t and np.abs(y - dense).max() > 1e-5 * max(np.abs(dense).max(), 1e-30):
                                what = "thresholds 0 / scale 0: not the dense product within 1e-5"
                            if not np.array_equal(kept, (x != 0).sum(axis=-1)):
                                what = "thresholds 0 / scale 0: kept is not the nonzero count"
                        if what is not None:
                            failures.append(
                                f"{fmt}/{wtype} K={k} N={n} T={t} thr={thr_name} bias={with_bias} scale={scale}: {what}"
                            )
    return failures + check_quant_edges(lib)


def check_quant_edges(lib: Path) -> list[str]:
    """q8 / q4 edges, bitwise against the reference: every row skipped (y = bias, kept 0), none skipped (no zero
    in x, thresholds 0), K-blocks keeping 0..8 rows (groups of 4 padded), x read from an unaligned buffer, every
    code and x code at an extreme."""
    failures = []
    k, n = 128, 96
    for fmt in ("q8", "q4"):
        w, ws, _ = weights(k, n, fmt, seed=11)
        bias = np.linspace(-1, 1, n, dtype=np.float32)
        x = activations(9, k, seed=12)
        x[x == 0] = 0.25
        pattern = np.zeros(k, np.float32)  # block b keeps its first (1, 2, 3, 5) rows (when x is large enough)
        for b, m in enumerate((1, 2, 3, 5)):
            pattern[32 * b + m : 32 * (b + 1)] = np.inf
        raw = np.zeros(x.size + 1, np.float32)
        raw[1:] = x.ravel()
        unaligned = raw[1:].reshape(x.shape)  # 4 bytes past the buffer's start
        for name, thr, xs in (
            ("all skipped", np.full(k, np.inf, np.float32), x),
            ("none skipped", np.zeros(k, np.float32), x),
            ("1/2/3/5 kept a block", pattern, x),
            ("unaligned x", np.full(k, 0.8, np.float32), unaligned),
        ):
            sess = session(lib, sparse_model(w, thr, fmt=fmt, w_scales=ws, bias=bias))
            for t in (1, 3, 9):
                y, kept = sess.run(None, {"x": xs[:t]})
                ref, ref_kept = sparse_linear_reference(xs[:t], w, thr, None, bias, ws, fmt)
                what = _mismatch(y, kept, ref, ref_kept, None, exact=True)
                if what is None and name == "all skipped" and not (np.array_equal(y, np.broadcast_to(bias, y.shape))
                                                                   and not kept.any()):  # fmt: skip
                    what = "every row skipped: y is not the bias"
                if what is None and name == "none skipped" and not np.array_equal(kept, np.full(t, k)):
                    what = "thresholds 0, no zero in x: not every row kept"
                if what is not None:
                    failures.append(f"{fmt} K={k} N={n} T={t} {name}: {what}")
    # The largest integer sums: every code at an extreme (q4 nibbles 15 / 0, q8 127 / -128), every x code +-127,
    # every row of a block kept (8 groups of 4: the AVX2 kernel's int16 sums at their bound); a whole q4 chunk and a
    # partial one (N = 160).
    n = 160
    ones = np.ones((k // 32, n), np.float16)
    for fmt, fills in (("q4", (0xFF, 0x00, 0x0F)), ("q8", (127, -128))):
        for fill in fills:
            if fmt == "q4":
                w = np.full((k, n // 2), fill, np.uint8)
            else:
                w = np.full((k, n), fill, np.int8)
            for xname, x in (("x +1", np.ones((3, k), np.float32)), ("x -+1", np.tile([-1.0, 1.0], (3, k // 2)))):
                x = x.astype(np.float32)
                sess = session(lib, sparse_model(w, np.zeros(k, np.float32), fmt=fmt, w_scales=ones))
                y, kept = sess.run(None, {"x": x})
                ref, ref_kept = sparse_linear_reference(x, w, np.zeros(k, np.float32), None, None, ones, fmt)
                what = _mismatch(y, kept, ref, ref_kept, None, exact=True)
                if what is not None:
                    failures.append(f"{fmt} K={k} N={n} codes {fill:#x} {xname}: {what}")
    return failures


def test_reference_is_the_dense_product_at_threshold_zero():
    for fmt, wtype, k, n in CASES:
        w, ws, _ = weights(k, n, fmt, wtype)
        x = activations(5, k, seed=1)
        y, kept = sparse_linear_reference(
            x, w, np.zeros(k, np.float32), w_scales=ws, weight_format=fmt, bf16=wtype == "bfloat16"
        )
        dense = x @ dense_weight(w, ws, fmt, wtype == "bfloat16") if fmt == "f" else quantized_dense(x, w, ws, fmt)
        assert np.abs(y - dense).max() <= 1e-5 * np.abs(dense).max()
        assert np.array_equal(kept, (x != 0).sum(axis=1))


def test_reference_skips_what_the_threshold_zeroes():
    # A channel at or under its threshold contributes nothing (even a NaN weight row); a NaN x is kept.
    w = np.ones((4, 3), np.float32)
    w[1] = np.nan
    x = np.array([[0.5, 0.2, -2.0, 0.1]], np.float32)
    y, kept = sparse_linear_reference(x, w, np.array([0.5, 0.2, 1.0, 0.0], np.float32))
    assert kept.tolist() == [2] and np.array_equal(y, np.full((1, 3), -1.9, np.float32))
    y, kept = sparse_linear_reference(np.array([[np.nan, 0, 0, 0]], np.float32), w, 0.0)
    assert kept.tolist() == [1] and np.isnan(y).all()
    assert sparse_linear_reference(x, w, 10.0, scale=0.0)[1].tolist() == [4]


def test_matches_reference(ort_lib):
    failures = check_matrix(ort_lib)
    assert not failures, "\n".join(failures[:20])


def test_leading_dims_and_kept_shape(ort_lib):
    w, ws, _ = weights(96, 64, "q4")
    thr = np.full(96, 0.6, np.float32)
    sess = session(ort_lib, sparse_model(w, thr, fmt="q4", w_scales=ws, lead=(2, 3)))
    x = activations(6, 96, seed=3).reshape(2, 3, 96)
    y, kept = sess.run(None, {"x": x})
    ref, ref_kept = sparse_linear_reference(x, w, thr, w_scales=ws, weight_format="q4")
    assert y.shape == (2, 3, 64) and kept.shape == (2, 3)
    assert _mismatch(y, kept, ref, ref_kept, None, exact=True) is None
    assert kept.min() > 0 and kept.max() < 96


@pytest.mark.parametrize("fmt", ["f", "q8", "q4"])
def test_threads_and_groups_do_not_change_the_result(ort_lib, fmt):
    # Bitwise: 1, 2, 4 intra-op threads; and a token alone (the decode path) = the same token in a group of 17.
    k = 520 if fmt == "f" else 512
    w, ws, _ = weights(k, 1000 if fmt == "f" else K_TILE + 96, fmt, seed=4)  # q8 / q4: two column tiles
    thr = np.full(k, 0.9, np.float32)
    model = sparse_model(
        w, thr, fmt=fmt, w_scales=ws, bias=np.linspace(-1, 1, w.shape[1] * (2 if fmt == "q4" else 1), dtype=np.float32)
    )
    x = activations(17, k, seed=5)
    outs = [session(ort_lib, model, threads).run(None, {"x": x}) for threads in (1, 2, 4)]
    for y, kept in outs[1:]:
        assert np.array_equal(y, outs[0][0]) and np.array_equal(kept, outs[0][1])
    one = session(ort_lib, model, 2)
    for t in (0, 8, 16):
        y, kept = one.run(None, {"x": x[t : t + 1]})
        assert np.array_equal(y[0], outs[0][0][t]) and kept[0] == outs[0][1][t]
    # One thread: the first calls split the columns in two ranges, later ones (the pool seen to have one thread)
    # run one range, every 16th split again: the same bits in every call.
    single = session(ort_lib, model, 1)
    for _ in range(20):
        y, kept = single.run(None, {"x": x[3:4]})
        assert np.array_equal(y[0], outs[0][0][3]) and kept[0] == outs[0][1][3]


def _script_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    env.update(extra)
    return env


_RUN = (
    "import sys, numpy as np, onnxruntime as ort\n"
    "o = ort.SessionOptions(); o.intra_op_num_threads = int(sys.argv[5]); o.register_custom_ops_library(sys.argv[1])\n"
    "s = ort.InferenceSession(sys.argv[2], o, providers=['CPUExecutionProvider'])\n"
    "f = dict(np.load(sys.argv[3])); np.save(sys.argv[4], s.run(None, f)[0])\n"
)


def _run_in_process(lib, model_path, inputs, out, threads=1, **env) -> np.ndarray:
    subprocess.run(
        [sys.executable, "-c", _RUN, str(lib), str(model_path), str(inputs), str(out), str(threads)],
        check=True,
        env=_script_env(**env),
        timeout=300,
    )
    return np.load(out)


@pytest.mark.parametrize("fmt", ["f", "q8", "q4"])
def test_column_split_does_not_change_the_result(ort_lib, tmp_path, fmt):
    # LAYERZERO_ORT_SPARSE_SPLIT forces the number of column ranges (1, 3, 7): the same bits every time.
    k = 200 if fmt == "f" else 224
    w, ws, _ = weights(k, 1000 if fmt == "f" else K_TILE + 96, fmt, seed=6)  # q8 / q4: ranges across a tile's end
    onnx.save(sparse_model(w, np.full(k, 0.8, np.float32), fmt=fmt, w_scales=ws), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=activations(5, k, seed=7))
    outs = [
        _run_in_process(
            ort_lib,
            tmp_path / "m.onnx",
            tmp_path / "in.npz",
            tmp_path / f"y{s}.npy",
            2,
            LAYERZERO_ORT_SPARSE_SPLIT=str(s),
        )
        for s in (1, 3, 7)
    ]
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_other_kernels_match_reference(ort_lib, isa):
    if isa == "avx2" and " avx2" not in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""):
        pytest.skip("this CPU has no AVX2")
    proc = subprocess.run(
        [sys.executable, __file__, str(ort_lib), "--quick", "--expect-isa", isa],
        capture_output=True,
        text=True,
        env=_script_env(LAYERZERO_ORT_ISA=isa),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("fmt", ["f", "q8", "q4"])
def test_best_and_portable_kernels_agree(ort_lib, tmp_path, fmt):
    # The same model and inputs on the best ISA (AVX-512 here) and on the portable kernels: close (f), the same
    # bits (q8 / q4: integer sums, then the same float steps).
    k = 300 if fmt == "f" else 320
    w, ws, _ = weights(k, 640 if fmt == "f" else K_TILE + 160, fmt, seed=8)
    onnx.save(sparse_model(w, np.full(k, 0.5, np.float32), fmt=fmt, w_scales=ws), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=activations(4, k, seed=9))
    best = _run_in_process(ort_lib, tmp_path / "m.onnx", tmp_path / "in.npz", tmp_path / "a.npy")
    portable = _run_in_process(
        ort_lib, tmp_path / "m.onnx", tmp_path / "in.npz", tmp_path / "b.npy", LAYERZERO_ORT_ISA="generic"
    )
    if fmt == "f":
        assert np.abs(best - portable).max() <= 1e-5 * np.abs(portable).max()
    else:
        assert np.array_equal(best, portable)


def _bad(**kw):
    k, n, fmt = kw.pop("k", 64), kw.pop("n", 64), kw.pop("fmt", "q4")
    w, ws, _ = weights(k if k % 32 == 0 else 64, n, fmt if fmt in ("f", "q8", "q4") else "q4")
    thr = kw.pop("thr", np.full(k, 0.1, np.float32))
    if "w" in kw:
        w = kw.pop("w")
    if "ws" in kw:
        ws = kw.pop("ws")
    return sparse_model(w, thr, fmt=fmt, w_scales=ws, **kw)


def _q4_codes_of_n(n):  # q4 codes of N = n columns (not a multiple of 32), built by hand
    return np.full((64, n // 2), 0x88, np.uint8), np.ones((2, n), np.float16)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda: _bad(x_k=65), "x's last dimension 65 is not w's K = 64"),
        (
            lambda: _bad(fmt="q8", w=np.zeros((64, 40), np.int8), ws=np.ones((2, 40), np.float16)),
            "N = 40 is not a multiple of the block length 32",
        ),
        (
            lambda: _bad(fmt="q8", k=40, w=np.zeros((40, 64), np.int8), ws=np.ones((1, 64), np.float16)),
            "K = 40 is not a multiple of the block length 32",
        ),
        (
            lambda: _bad(w=_q4_codes_of_n(72)[0], ws=_q4_codes_of_n(72)[1]),
            "N = 72 is not a multiple of the block length 32",
        ),
        (lambda: _bad(fmt="q8", w=np.zeros((64, 64), np.uint8)), "w has element type uint8; weight_format='q8'"),
        (lambda: _bad(fmt="f", w=np.zeros((64, 64), np.float64), ws=None), "w has element type float64"),
        (
            lambda: _bad(fmt="f", w=np.zeros((64, 64), np.float32), ws=np.ones((64, 2), np.float16)),
            "w_scales (input 5) is for weight_format q8 / q4",
        ),
        (lambda: _bad(thr=np.zeros(64, np.float64)), "thresholds must be float32"),
        (lambda: _bad(thr=np.zeros(63, np.float32)), "thresholds must be [K] = [64]"),
        (lambda: _bad(thr=np.full(64, -1.0, np.float32)), "thresholds[0] = -1.000000 (>= 0)"),
        (lambda: _bad(ws=np.ones((2, 64), np.float32)), "w_scales must be float16"),
        (lambda: _bad(ws=np.ones((64, 2), np.float16)), "w_scales must be [K/32, N] = [2, 64]"),
        (lambda: _bad(ws=None), "needs w_scales"),
        (lambda: _bad(fmt="q3"), "weight_format='q3' is not implemented"),
        (lambda: _bad(block_size=64), "block_size=64 is not implemented"),
        # a bundle compiled with an older code layout (no attribute: the row-major layout before column tiles)
        (lambda: _bad(code_layout=0), f"code_layout=0: its q4 codes are not in this library's layout {LAYOUT}"),
        # ... and with layout 1 (column tiles of 2048, before the tiles of 8192)
        (lambda: _bad(code_layout=1), f"code_layout=1: its q4 codes are not in this library's layout {LAYOUT}"),
        (lambda: _bad(bias=np.zeros(65, np.float32)), "bias must be [N] = [64]"),
    ],
)
def test_session_creation_refuses(ort_lib, model, message):
    with pytest.raises(Exception) as info:
        session(ort_lib, model())
    text = str(info.value)
    assert message in text and NODE in text, text
    assert "\n" not in text.split(NODE, 1)[1].strip()


def test_scale_checked_when_the_node_runs(ort_lib):
    w, ws, _ = weights(64, 64, "q8")
    sess = session(ort_lib, sparse_model(w, np.full(64, 0.1, np.float32), fmt="q8", w_scales=ws, scale_input=True))
    with pytest.raises(Exception) as info:
        sess.run(None, {"x": activations(1, 64, 0), "scale": np.array(-1.0, np.float32)})
    assert "scale -1.000000 (>= 0)" in str(info.value) and NODE in str(info.value)


def test_isa_is_reported(ort_lib):
    isa = ctypes.CDLL(str(ort_lib)).LayerZeroOrtSparseIsa
    isa.restype = ctypes.c_char_p
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    want = "avx512" if " avx512bw" in flags and " avx512vl" in flags else "avx2" if " avx2" in flags else "generic"
    assert isa().decode() == want
    qisa = ctypes.CDLL(str(ort_lib)).LayerZeroOrtSparseQIsa
    qisa.restype = ctypes.c_char_p
    vnni = all(f" {f}" in flags for f in ("avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"))
    assert qisa().decode() == ("avx512vnni" if vnni else "avx2" if " avx2" in flags else "generic")


def test_address_sanitizer(ort_lib_asan):
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).exists():
        _absent("libasan.so not found (g++ -print-file-name=libasan.so)")
    env = _script_env(LD_PRELOAD=str(Path(libasan).resolve()), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    for isa in ("", "avx2", "generic"):
        proc = subprocess.run(
            [sys.executable, __file__, str(ort_lib_asan), "--quick"],
            capture_output=True,
            text=True,
            env=dict(env, LAYERZERO_ORT_ISA=isa),
            timeout=1800,
        )
        assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _main(argv: list[str]) -> int:
    lib = Path(argv[0])
    if "--expect-isa" in argv:
        isa = ctypes.CDLL(str(lib)).LayerZeroOrtSparseIsa
        isa.restype = ctypes.c_char_p
        want = argv[argv.index("--expect-isa") + 1]
        if isa().decode() != want:
            print(f"SparseLinear kernels in use: {isa().decode()}, expected {want}")
            return 1
        qisa = ctypes.CDLL(str(lib)).LayerZeroOrtSparseQIsa
        qisa.restype = ctypes.c_char_p
        if qisa().decode() != want:
            print(f"SparseLinear q8 / q4 kernels in use: {qisa().decode()}, expected {want}")
            return 1
    failures = check_matrix(lib, quick="--quick" in argv)
    print("\n".join(failures[:50]) or "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
