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


def _model(with_mask: bool = True, **attrs) -> onnx.ModelProto:
    names = ["q", "k", "v"] + (["mask"] if with_mask else [])
    node = helper.make_node("Attention", names, ["o"], domain="ai.layerzero", name=NODE, **attrs)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    graph = helper.make_graph([node], "attn", inputs, [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
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
