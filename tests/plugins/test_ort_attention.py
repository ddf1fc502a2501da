"""liblayerzero_ort.so's ``ai.layerzero::Attention`` (the attention core that ``--linear-kernel native`` fuses) against
``plugins/reference.py``'s ``attention_reference``: grouped heads, broadcast masks and batches, fully masked rows,
both output layouts, T = 0 / 1 / many, L = 0, 1 and 2 threads, and its one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from layerzero.plugins.reference import attention_reference
from tests.plugins.ort_moe import session

NODE = "model.layers.0.self_attn/Attention"
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)]
NEG = np.float32(np.finfo(np.float32).min)
#: (B, H, Hk, T, L) of the reference matrix (also run under AddressSanitizer).
SHAPES = [(1, 16, 4, 1, 37), (2, 8, 8, 5, 5), (1, 4, 1, 3, 70), (3, 6, 2, 0, 4), (2, 4, 2, 67, 80), (1, 4, 2, 2, 0)]


def _model(with_mask: bool = True, past: bool = False, outputs: int | None = None, **attrs) -> onnx.ModelProto:
    names = ["q", "k", "v"] + (["mask"] if with_mask else [""] if past else []) + (["pk", "pv"] if past else [])
    outs = ["o", "present_k", "present_v"][: outputs or (3 if past else 1)]
    node = helper.make_node("Attention", names, outs, domain="ai.layerzero", name=NODE, **attrs)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n]
    graph = helper.make_graph(
        [node], "attn", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    )
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def _causal(rng, B, T, L, pad=0) -> np.ndarray:
    """The exporters' additive mask [B, 1, T, L]: 0 where visible (causal, the first ``pad`` keys of row 0 padded),
    float32 min elsewhere."""
    past = L - T
    visible = np.arange(L)[None, :] <= (past + np.arange(T))[:, None]
    m = np.where(visible, 0.0, NEG).astype(np.float32)[None, None].repeat(B, 0)
    m[0, :, :, :pad] = NEG
    return m


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "H", "Hk", "T", "L"), SHAPES)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_matches_the_reference(ort_lib, threads, B, H, Hk, T, L, layout):
    _check(ort_lib, threads, B, H, Hk, T, L, layout)


def _check(lib, threads, B, H, Hk, T, L, layout):
    rng = np.random.default_rng(B * 1000 + H * 100 + T * 10 + L)
    D = 64
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hk, L, D)).astype(np.float32)
    mask = _causal(rng, B, T, L, pad=min(2, max(L - T, 0))) if 0 < T <= L else None
    scale = float(np.float32(D**-0.25))
    attrs = {"q_scale": scale, "k_scale": scale, "output_layout": layout}
    sess = session(lib, _model(mask is not None, **attrs), threads)
    feeds = {"q": q, "k": k, "v": v} | ({"mask": mask} if mask is not None else {})
    (o,) = sess.run(None, feeds)
    ref = attention_reference(q, k, v, mask, scale, scale, layout)
    assert o.shape == ref.shape and o.dtype == np.float32
    np.testing.assert_allclose(o, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "H", "Hk", "T", "P"), [(1, 16, 4, 1, 36), (2, 8, 2, 3, 5), (1, 4, 4, 6, 0)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_past_form_writes_the_presents_and_attends_over_them(ort_lib, threads, B, H, Hk, T, P, with_mask):
    """With past_key / past_value the op is the cache's Concat and the attention in one: outputs 1 and 2 are
    concat(past, new) along the sequence (bitwise), output 0 the attention over them."""
    rng = np.random.default_rng(B * 100 + T * 10 + P)
    D = 32
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, T, D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, Hk, P, D)).astype(np.float32) for _ in range(2))
    mask = _causal(rng, B, T, P + T, pad=min(2, P)) if with_mask else None
    sess = session(ort_lib, _model(with_mask, past=True, q_scale=0.5, k_scale=0.25), threads)
    feeds = {"q": q, "k": k, "v": v, "pk": pk, "pv": pv} | ({"mask": mask} if with_mask else {})
    o, present_k, present_v = sess.run(None, feeds)
    assert np.array_equal(present_k, np.concatenate([pk, k], axis=2))
    assert np.array_equal(present_v, np.concatenate([pv, v], axis=2))
    ref = attention_reference(q, present_k, present_v, mask, 0.5, 0.25)
    np.testing.assert_allclose(o, ref, rtol=2e-5, atol=2e-6)
    # ... and equal to the op without a past, fed the presents (the same rows, the same order of arithmetic).
    plain = session(ort_lib, _model(with_mask, q_scale=0.5, k_scale=0.25), threads)
    rest = {"q": q, "k": present_k, "v": present_v} | ({"mask": mask} if with_mask else {})
    assert np.array_equal(o, plain.run(None, rest)[0])


@pytest.mark.parametrize(
    ("shapes", "expected"),
    [
        ({"pk": (1, 2, 3, 8), "pv": (1, 2, 4, 8)}, "do not fit the new keys"),
        ({"pk": (1, 3, 3, 8), "pv": (1, 3, 3, 8)}, "do not fit the new keys"),
    ],
)
def test_past_of_another_shape_is_one_line(ort_lib, shapes, expected):
    sess = session(ort_lib, _model(False, past=True), 1)
    sizes = {"q": (1, 4, 1, 8), "k": (1, 2, 1, 8), "v": (1, 2, 1, 8)} | shapes
    feeds = {n: np.zeros(s, np.float32) for n, s in sizes.items()}
    with pytest.raises(Exception) as info:
        sess.run(None, feeds)
    assert expected in str(info.value) and NODE in str(info.value)


def test_outputs_must_fit_the_inputs(ort_lib):
    with pytest.raises(Exception, match="with a past it writes o, present_key, present_value"):
        session(ort_lib, _model(False, past=True, outputs=1), 1)


def _bsh_model(norms: bool, rope: bool, with_mask: bool, heads: int, kv_heads: int, eps: float) -> onnx.ModelProto:
    names = ["q", "k", "v", "mask" if with_mask else "", "pk", "pv"]
    names += (["qn", "kn"] if norms else ["", ""]) + (["cos", "sin", "ids"] if rope else [])
    while not names[-1]:
        names.pop()
    node = helper.make_node("Attention", names, ["o", "present_k", "present_v"], domain="ai.layerzero", name=NODE,
                            input_layout="bsh", num_heads=heads, kv_num_heads=kv_heads, norm_epsilon=eps,
                            q_scale=0.3, k_scale=0.4)  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "ids" else TensorProto.FLOAT, None)
              for n in names if n]  # fmt: skip
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("o", "present_k", "present_v")]
    graph = helper.make_graph([node], "attn", inputs, outs)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def _heads(x: np.ndarray, heads: int, norm: np.ndarray | None, eps: float, cos=None, sin=None, ids=None):
    """numpy of the bsh preparation: [B, T, heads * D] -> [B, heads, T, D], RMS norm, rotate_half rotary."""
    B, T, _ = x.shape
    h = x.reshape(B, T, heads, -1).astype(np.float64)
    if norm is not None:
        h = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * norm
    h = h.transpose(0, 2, 1, 3)
    if cos is not None:
        c, s = cos[ids][:, None].astype(np.float64), sin[ids][:, None].astype(np.float64)  # [B, 1, T, D/2]
        half = h.shape[-1] // 2
        x1, x2 = h[..., :half], h[..., half:]
        h = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return h.astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("norms", "rope"), [(True, True), (False, True), (False, False), (True, False)])
@pytest.mark.parametrize(("B", "H", "Hk", "T", "P"), [(1, 8, 2, 1, 20), (2, 4, 4, 5, 3), (1, 4, 2, 3, 0)])
def test_bsh_layout_prepares_the_heads(ort_lib, threads, norms, rope, B, H, Hk, T, P):
    """input_layout "bsh": q / k / v as the projections write them, each head through the RMS norm and the rotary
    embedding of its position (the graph's SimplifiedLayerNormalization / RotaryEmbedding), then the past form;
    the output [B, T, H * D]."""
    rng = np.random.default_rng(B * 100 + T * 10 + P + H)
    D, eps, rows = 16, 1e-6, 64
    q = rng.standard_normal((B, T, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, Hk * D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, Hk, P, D)).astype(np.float32) for _ in range(2))
    qn, kn = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    angles = np.arange(rows)[:, None] * rng.uniform(0.01, 1.0, D // 2)[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ids = (P + np.arange(T))[None].repeat(B, 0).astype(np.int64)
    mask = _causal(rng, B, T, P + T, pad=min(2, P))
    feeds = {"q": q, "k": k, "v": v, "mask": mask, "pk": pk, "pv": pv}
    feeds |= ({"qn": qn, "kn": kn} if norms else {}) | ({"cos": cos, "sin": sin, "ids": ids} if rope else {})
    o, present_k, present_v = session(ort_lib, _bsh_model(norms, rope, True, H, Hk, eps), threads).run(None, feeds)
    r = (cos, sin, ids) if rope else ()
    qh = _heads(q, H, qn if norms else None, eps, *r)
    kh = _heads(k, Hk, kn if norms else None, eps, *r)
    np.testing.assert_allclose(present_k, np.concatenate([pk, kh], axis=2), rtol=1e-5, atol=1e-5)
    assert np.array_equal(present_v, np.concatenate([pv, _heads(v, Hk, None, eps)], axis=2))
    ref = attention_reference(qh, present_k, present_v, mask, 0.3, 0.4, "bthd").reshape(B, T, H * D)
    assert o.shape == (B, T, H * D)
    np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ({"ids": np.array([[70]], np.int64)}, "position id 70 is outside the rotary caches' 64 rows"),
        ({"qn": np.ones(8, np.float32)}, "the norm weight (input 6) is [8], not [16]"),
        ({"k": np.zeros((1, 2, 32), np.float32)}, "must be [B, T, heads * D] of one B and T"),
    ],
)
def test_bsh_bad_inputs_are_one_line(ort_lib, case, expected):
    D = 16
    feeds = {"q": np.zeros((1, 1, 4 * D), np.float32), "k": np.zeros((1, 1, 2 * D), np.float32),
             "v": np.zeros((1, 1, 2 * D), np.float32), "mask": np.zeros((1, 1, 1, 1), np.float32),
             "pk": np.zeros((1, 2, 0, D), np.float32), "pv": np.zeros((1, 2, 0, D), np.float32),
             "qn": np.ones(D, np.float32), "kn": np.ones(D, np.float32), "cos": np.ones((64, D // 2), np.float32),
             "sin": np.zeros((64, D // 2), np.float32), "ids": np.zeros((1, 1), np.int64)} | case  # fmt: skip
    sess = session(ort_lib, _bsh_model(True, True, True, 4, 2, 1e-6), 1)
    with pytest.raises(Exception) as info:
        sess.run(None, feeds)
    assert expected in str(info.value) and NODE in str(info.value)


def test_bsh_needs_head_counts(ort_lib):
    with pytest.raises(Exception, match="needs num_heads and kv_num_heads > 0"):
        session(ort_lib, _bsh_model(False, False, True, 6, 4, 1e-6), 1)


def test_bitwise_equal_across_threads_and_batched_alone(ort_lib):
    rng = np.random.default_rng(7)
    B, H, Hk, T, L, D = 3, 8, 2, 4, 50, 32
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hk, L, D)).astype(np.float32)
    mask = _causal(rng, B, T, L, pad=3)
    outs = [session(ort_lib, _model(), t).run(None, {"q": q, "k": k, "v": v, "mask": mask})[0] for t in (1, 2)]
    assert np.array_equal(outs[0], outs[1])
    alone = session(ort_lib, _model(), 2).run(None, {"q": q[1:2], "k": k[1:2], "v": v[1:2], "mask": mask[1:2]})[0]
    assert np.array_equal(alone, outs[0][1:2])


def test_fully_masked_rows_and_nan_are_zero_rows(ort_lib):
    """A row whose scores are all -inf (or hold a NaN) has NaN probabilities: the exporters' Where(IsNaN) makes
    them 0, so its output row is 0; a row masked with float32 min (not -inf) is a uniform average instead."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    mask = np.zeros((1, 1, 3, 4), np.float32)
    mask[0, 0, 0, :] = -np.inf
    mask[0, 0, 1, :] = NEG
    mask[0, 0, 2, 1] = np.nan
    (o,) = session(ort_lib, _model(), 1).run(None, {"q": q, "k": k, "v": v, "mask": mask})
    assert np.array_equal(o[0, :, 0], np.zeros((2, 8), np.float32))
    assert np.array_equal(o[0, :, 2], np.zeros((2, 8), np.float32))
    np.testing.assert_allclose(o[0, :, 1], v[0].mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o, attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_broadcast_batch_and_no_keys(ort_lib):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 16)).astype(np.float32)
    (o,) = session(ort_lib, _model(False), 2).run(None, {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(o, attention_reference(q, k, v), rtol=1e-5, atol=1e-6)
    empty = np.zeros((2, 2, 0, 16), np.float32)
    (o,) = session(ort_lib, _model(False), 1).run(None, {"q": q, "k": empty, "v": empty})
    assert o.shape == (2, 4, 2, 16) and not o.any()


@pytest.mark.parametrize(
    ("feeds", "expected"),
    [
        ({"q": (1, 6, 1, 8), "k": (1, 4, 3, 8), "v": (1, 4, 3, 8)}, "heads 6 are not a multiple of k's 4"),
        ({"q": (1, 4, 1, 8), "k": (1, 2, 3, 8), "v": (1, 2, 5, 8)}, "do not fit"),
        ({"q": (2, 4, 1, 8), "k": (3, 2, 3, 8), "v": (3, 2, 3, 8)}, "k's batch 3 is neither"),
        ({"q": (1, 4, 8), "k": (1, 2, 3, 8), "v": (1, 2, 3, 8)}, "must be rank 4"),
        ({"q": (1, 4, 2, 8), "k": (1, 2, 3, 8), "v": (1, 2, 3, 8), "mask": (1, 1, 3, 3)}, "does not broadcast"),
    ],
)
def test_wrong_shapes_are_one_line_errors(ort_lib, feeds, expected):
    with_mask = "mask" in feeds
    sess = session(ort_lib, _model(with_mask), 1)
    arrays = {name: np.zeros(shape, np.float32) for name, shape in feeds.items()}
    with pytest.raises(Exception) as info:
        sess.run(None, arrays)
    message = str(info.value)
    assert expected in message and NODE in message and "\n" not in message.strip()


def test_unknown_layout_refused_when_the_session_is_made(ort_lib):
    with pytest.raises(Exception, match="output_layout='bsd' is not implemented"):
        session(ort_lib, _model(output_layout="bsd"), 1)


def test_address_sanitizer(ort_lib_asan):
    """The reference matrix again in a child process with the AddressSanitizer build preloaded."""
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).exists():
        if os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1":
            pytest.fail("LAYERZERO_REQUIRE_NATIVE=1: libasan.so not found (g++ -print-file-name=libasan.so)")
        pytest.skip("libasan.so not found (g++ -print-file-name=libasan.so)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LD_PRELOAD=str(Path(libasan).resolve()),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")  # fmt: skip
    proc = subprocess.run([sys.executable, __file__, str(ort_lib_asan)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    for shape in SHAPES:
        for layout in ("bhtd", "bthd"):
            _check(Path(sys.argv[1]), 2, *shape, layout)
    print("ok")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_place", [True, False])
def test_cache_buffer_writes_the_new_rows_where_the_mask_ends(ort_lib, threads, in_place):
    """A past longer than the mask says (a cache buffer of capacity M, ``Lm - Tn`` rows in use): the presents have
    the buffer's shape, the new rows land at ``[Lm - Tn, Lm)``, o equals the ordinary form's over the rows in use.
    Bound as one buffer for past and present (``in_place``), only the new rows are written (the rest untouched)."""
    import onnxruntime as ort

    B, H, Hk, D, M, eps = 2, 8, 2, 16, 24, 1e-6
    rng = np.random.default_rng(11)
    sess = session(ort_lib, _bsh_model(False, False, True, H, Hk, eps), threads)
    cache = [np.zeros((B, Hk, M, D), np.float32) for _ in range(2)]
    sentinel = np.float32(7.0)
    for c in cache:
        c[:, :, :, :] = sentinel
    steps = [(5, 0), (1, 5), (1, 6), (3, 7)]  # (new tokens, past rows in use)
    ordinary = [np.zeros((B, Hk, 0, D), np.float32) for _ in range(2)]
    for tn, used in steps:
        q = rng.standard_normal((B, tn, H * D)).astype(np.float32)
        k, v = (rng.standard_normal((B, tn, Hk * D)).astype(np.float32) for _ in range(2))
        mask = _causal(rng, B, tn, used + tn, pad=min(1, used))
        feeds = {"q": q, "k": k, "v": v, "mask": mask}
        want = sess.run(None, {**feeds, "pk": ordinary[0], "pv": ordinary[1]})
        ordinary = want[1:]
        if in_place:
            binding = sess.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            values = [ort.OrtValue.ortvalue_from_numpy(c) for c in cache]  # the arrays' own memory
            binding.bind_ortvalue_input("pk", values[0])
            binding.bind_ortvalue_input("pv", values[1])
            binding.bind_output("o", "cpu")
            binding.bind_ortvalue_output("present_k", values[0])
            binding.bind_ortvalue_output("present_v", values[1])
            sess.run_with_iobinding(binding)
            o = binding.get_outputs()[0].numpy()
            presents = cache
        else:
            o, *presents = sess.run(None, {**feeds, "pk": cache[0], "pv": cache[1]})
            assert all(p.shape == (B, Hk, M, D) for p in presents)
            assert not presents[0][:, :, used + tn :].any()  # a copied buffer: the rows after those in use are 0
            cache = [p.copy() for p in presents]
            cache[0][:, :, used + tn :] = sentinel
            cache[1][:, :, used + tn :] = sentinel
        np.testing.assert_allclose(o, want[0], rtol=1e-5, atol=1e-6)
        for got, full in zip(presents, want[1:]):
            assert np.array_equal(got[:, :, : used + tn], full)
        if in_place:
            assert (cache[0][:, :, used + tn :] == sentinel).all()  # only the new rows were written


@pytest.mark.parametrize(("tn", "keys", "expected"), [(2, 5, "more than the cache buffer's 4 rows"),
                                                       (3, 2, "fewer than the new keys")])  # fmt: skip
def test_cache_buffer_misfits_are_one_line(ort_lib, tn, keys, expected):
    """A mask of fewer keys than past + new makes the past a cache buffer: more keys than its rows, or fewer than the
    new ones, is a one-line error naming the node."""
    B, H, Hk, D = 1, 4, 2, 16
    sess = session(ort_lib, _bsh_model(False, False, True, H, Hk, 1e-6))
    feeds = {"q": np.zeros((B, tn, H * D), np.float32), "k": np.zeros((B, tn, Hk * D), np.float32),
             "v": np.zeros((B, tn, Hk * D), np.float32), "mask": np.zeros((B, 1, tn, keys), np.float32),
             "pk": np.zeros((B, Hk, 4, D), np.float32), "pv": np.zeros((B, Hk, 4, D), np.float32)}  # fmt: skip
    with pytest.raises(Exception) as failure:
        sess.run(None, feeds)
    text = str(failure.value)
    assert expected in text and NODE in text and "\n" not in text.strip(), text


@pytest.mark.parametrize("threads", [1, 2])
def test_rotary_from_frequencies_equals_the_cache_form(ort_lib, threads):
    """``rotary_form="inv_freq"``: input 8 the frequencies [D/2], 9 empty; the op's cos / sin of float(position) *
    inv_freq equal the cache form's rows of the same float32 angles (what the graph's Cos / Sin computed)."""
    B, H, Hk, T, P, D = 2, 4, 2, 3, 6, 16
    rng = np.random.default_rng(21)
    inv = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    ids = (P + np.arange(T))[None].repeat(B, 0).astype(np.int64)
    ids[1] -= 2  # another row's own positions
    angles = ids.reshape(-1).astype(np.float32)[:, None] * inv[None]  # float32, as Cast + Mul
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rows = np.arange(B * T, dtype=np.int64).reshape(B, T)  # FuseDecoder's per-token tables: row b * T + t
    q = rng.standard_normal((B, T, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, Hk * D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, Hk, P, D)).astype(np.float32) for _ in range(2))
    base = {"q": q, "k": k, "v": v, "mask": _causal(rng, B, T, P + T), "pk": pk, "pv": pv}
    cache = session(ort_lib, _bsh_model(False, True, True, H, Hk, 1e-6), threads)
    want = cache.run(None, {**base, "cos": cos, "sin": sin, "ids": rows})
    model = _bsh_model(False, True, True, H, Hk, 1e-6)
    node = model.graph.node[0]
    node.input[9] = ""
    node.attribute.append(helper.make_attribute("rotary_form", "inv_freq"))
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "sin"))
    got = session(ort_lib, model, threads).run(None, {**base, "cos": inv, "ids": ids})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    with pytest.raises(Exception, match="inv_freq \\[4\\] / position_ids"):
        session(ort_lib, model, threads).run(None, {**base, "cos": inv[:4].copy(), "ids": ids})


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "T", "P"), [(1, 1, 0), (2, 1, 9), (2, 4, 5), (3, 6, 0)])
def test_padding_causal_mask_equals_the_exporters_additive_mask(ort_lib, threads, B, T, P):
    """``mask_form="padding_causal"``: input 3 the attention mask [B, P + T] (int64); the op's mask is the exporters'
    ``Where(attention_mask[b, l] != 0 and l <= P + t, 0, float32 min)``: the same outputs as that additive mask,
    left-padded rows and a padded key amid the others included."""
    H, Hk, D = 4, 2, 16
    rng = np.random.default_rng(B * 100 + T * 10 + P)
    am = np.ones((B, P + T), np.int64)
    if B > 1:
        am[1, :2] = 0
        am[-1, (P + T) // 2] = 0
    keys, queries = np.arange(P + T)[None, None, None, :], (P + np.arange(T))[None, None, :, None]
    visible = (am[:, None, None, :] != 0) & (keys <= queries)
    additive = np.where(visible, 0.0, NEG).astype(np.float32)
    q = rng.standard_normal((B, T, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, Hk * D)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((B, Hk, P, D)).astype(np.float32) for _ in range(2))
    feeds = {"q": q, "k": k, "v": v, "pk": pk, "pv": pv}
    want = session(ort_lib, _bsh_model(False, False, True, H, Hk, 1e-6), threads).run(None, {**feeds, "mask": additive})
    model = _bsh_model(False, False, True, H, Hk, 1e-6)
    model.graph.node[0].attribute.append(helper.make_attribute("mask_form", "padding_causal"))
    model.graph.input[3].type.tensor_type.elem_type = TensorProto.INT64
    got = session(ort_lib, model, threads).run(None, {**feeds, "mask": am})
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    with pytest.raises(Exception, match="is not \\[B, L\\]"):
        session(ort_lib, model, threads).run(None, {**feeds, "mask": np.ones((B, P + T + 1), np.int64)})
