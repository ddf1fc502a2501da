"""liblayerzero_ort.so, the ONNX Runtime CPU custom op ``ai.layerzero::MoE``: against ``plugins/reference.py`` for
every routing variant, threshold, dtype, T = 0 / 1 / many and experts no token uses, on the AVX2 and the portable
kernels and under AddressSanitizer; session-creation refusals; the native lowering, bundle, runtime and Triton
export; auto's choice.

The library is built once per session into ``build/ort-test`` (incremental; never ~/.cache;
``LAYERZERO_ORT_TEST_BUILD`` names another directory). Without the ONNX
Runtime headers (``scripts/fetch_ort_headers.sh``) or cmake the tests skip with the reason, except under
``LAYERZERO_REQUIRE_NATIVE=1`` (CI), where the headers are fetched and any absence fails.

Run as a script (``python tests/plugins/test_ort_native.py LIB``) it checks the matrix against ``LIB`` and exits
non-zero on a mismatch: the subprocess tests use that for the portable kernels and the ASan build.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins import ort_library
from layerzero.plugins.loader import PluginError
from layerzero.plugins.reference import moe_reference

if __name__ == "__main__":  # run as a script (above): tests.plugins imports from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.plugins import ort_moe
from tests.plugins.ort_moe import THRESHOLD, VARIANTS, session

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("LAYERZERO_ORT_TEST_BUILD") or REPO / "build" / "ort-test")


# ort_lib / ort_lib_asan: tests/plugins/conftest.py (one build per session for every plugin test).


# ------------------------------------------------------------------------------------------------ the model


def _weights(experts: int, ffn: int, hidden: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(hidden)
    return (
        (rng.standard_normal((experts, ffn, hidden)) * scale).astype(np.float32),
        (rng.standard_normal((experts, ffn, hidden)) * scale).astype(np.float32),
        (rng.standard_normal((experts, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32),
    )


def _weight_tensor(name: str, array: np.ndarray, wtype: str) -> tuple[onnx.TensorProto, np.ndarray]:
    """The initializer and the float32 values the kernel reads (exactly: fp16 / bf16 widen without rounding)."""
    if wtype == "bfloat16":
        bits = (array.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 value will do
        tensor = helper.make_tensor(name, TensorProto.BFLOAT16, array.shape, bits.tobytes(), raw=True)
        return tensor, (bits.astype(np.uint32) << 16).view(np.float32)
    converted = array.astype(wtype)
    return numpy_helper.from_array(converted, name), converted.astype(np.float32)


def moe_model(
    experts: int = 8,
    ffn: int = 40,
    hidden: int = 36,
    *,
    wtype: str = "float32",
    htype: str = "float32",
    threshold_input: bool = False,
    seed: int = 0,
    extra_inputs: int = 0,
    weight_types: tuple[str, str, str] | None = None,
    **attrs: object,
) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """One ``ai.layerzero::MoE`` node over initializer weights; the weights as the kernel reads them."""
    inits, widened = [], []
    for name, array, wt in zip(
        ("w_gate", "w_up", "w_down"), _weights(experts, ffn, hidden, seed), weight_types or (wtype,) * 3, strict=True
    ):
        if wt in ("int8", "float64"):
            tensor, values = numpy_helper.from_array(array.astype(wt), name), array
        else:
            tensor, values = _weight_tensor(name, array, wt)
        inits.append(tensor)
        widened.append(values)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(htype))
    inputs = [
        helper.make_tensor_value_info("hidden", elem, ["T", hidden]),
        helper.make_tensor_value_info("logits", elem, ["T", experts]),
    ]
    names = ["hidden", "logits", "w_gate", "w_up", "w_down"]
    if threshold_input:
        inputs.append(helper.make_tensor_value_info(THRESHOLD, TensorProto.FLOAT, []))
        names.append(THRESHOLD)
    for i in range(extra_inputs):
        inputs.append(helper.make_tensor_value_info(f"extra{i}", TensorProto.FLOAT, [experts]))
        names.append(f"extra{i}")
    return ort_moe.moe_node_model(names, inputs, elem, experts, hidden, inits, **attrs), widened


def _relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    if y.size == 0:
        return 0.0
    return float(np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


# The matrix: every routing variant x threshold x weight dtype x T, on shapes with tails (H, F not multiples of 8,
# F not a multiple of the 4-row block) and experts no token uses (16 experts, top-2, a few tokens).
SHAPES = [(8, 40, 36), (16, 43, 64)]


def check_matrix(lib: Path, quick: bool = False) -> list[str]:
    """Mismatches (empty when the library agrees with the reference everywhere)."""
    failures = []
    rng = np.random.default_rng(1)
    variants = VARIANTS[::5] if quick else VARIANTS
    for experts, ffn, hidden in SHAPES:
        for wtype in ("float32", "float16", "bfloat16"):
            for variant in variants:
                for threshold in (0.0, 0.4):
                    model, w = moe_model(experts, ffn, hidden, wtype=wtype, zeroing_threshold=threshold, **variant)
                    sess = session(lib, model)
                    for tokens in (0, 1, 3, 37):
                        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
                        logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
                        y, mask = sess.run(None, {"hidden": x, "logits": logits})
                        ref, ref_mask = moe_reference(x, logits, *w, zeroing_threshold=threshold, **variant)
                        where = f"E{experts} F{ffn} H{hidden} {wtype} {variant} thr={threshold} T={tokens}"
                        if y.shape != (tokens, hidden) or mask.shape != (tokens, experts):
                            failures.append(f"{where}: shapes {y.shape} {mask.shape}")
                        elif not np.array_equal(mask, ref_mask):
                            failures.append(f"{where}: mask differs")
                        elif (err := _relative_error(y, ref.astype(np.float64))) > 1e-5:
                            failures.append(f"{where}: relative error {err:.2e}")
    return failures


# -------------------------------------------------------------------------------------------- kernel tests


def test_matches_reference_every_variant(ort_lib):
    failures = check_matrix(ort_lib)
    assert not failures, "\n".join(failures[:20])


def test_unused_experts_and_mask(ort_lib):
    # 16 experts, top-2, 2 tokens: at most 4 run; the mask says which, and only those (checked per entry).
    model, w = moe_model(16, 40, 36, top_k=2, normalize=1)
    logits = np.full((2, 16), -5.0, np.float32)
    logits[0, [3, 9]] = [2.0, 1.0]
    logits[1, [3, 12]] = [1.5, 2.5]
    x = np.random.default_rng(2).standard_normal((2, 36)).astype(np.float32)
    y, mask = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})
    assert sorted(map(tuple, np.argwhere(mask))) == [(0, 3), (0, 9), (1, 3), (1, 12)]
    ref, _ = moe_reference(x, logits, *w, top_k=2, normalize=1)
    assert _relative_error(y, ref) < 1e-5


def test_ties_go_to_the_lower_expert(ort_lib):
    model, w = moe_model(8, 40, 36, top_k=2, normalize=1)
    logits = np.zeros((3, 8), np.float32)  # all equal: experts 0 and 1, as ONNX TopK
    x = np.random.default_rng(3).standard_normal((3, 36)).astype(np.float32)
    y, mask = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})
    assert mask[:, :2].all() and not mask[:, 2:].any()
    assert _relative_error(y, moe_reference(x, logits, *w, top_k=2, normalize=1)[0]) < 1e-5


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_nan_logits_run_no_expert_of_that_token(ort_lib, scoring):
    # A NaN logit ranks last (the reference's argsort) and a NaN weight keeps the token's experts from running;
    # the other tokens are untouched. (Ordering NaN as is would make the top-k sort undefined.)
    model, w = moe_model(8, 40, 36, top_k=8, normalize=0, scoring=scoring)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 36)).astype(np.float32)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    logits[1, 5] = np.nan
    y, mask = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})
    with np.errstate(invalid="ignore"):
        ref, ref_mask = moe_reference(x, logits, *w, top_k=8, normalize=0, scoring=scoring)
    assert np.array_equal(mask, ref_mask) and not mask[1].any() and mask[[0, 2]].all()
    assert _relative_error(y[[0, 2]], ref[[0, 2]]) < 1e-5 and not y[1].any()


def test_threshold_input_overrides_the_attribute(ort_lib):
    model, w = moe_model(8, 40, 36, top_k=4, normalize=1, zeroing_threshold=0.0, threshold_input=True)
    sess = session(ort_lib, model)
    x, logits = ort_moe.random_feeds(np.random.default_rng(4), 9, 36, 8, logit_scale=2).values()
    counts = []
    for threshold, y, mask in ort_moe.threshold_runs(sess, x, logits):
        ref, ref_mask = moe_reference(x, logits, *w, top_k=4, normalize=1, zeroing_threshold=threshold)
        assert np.array_equal(mask, ref_mask)
        assert _relative_error(y, ref) < 1e-5
        counts.append(int(mask.sum()))
    assert counts[0] == 36 and counts[0] > counts[1] > counts[2] >= 9  # the threshold really skips


def test_float16_hidden(ort_lib):
    model, w = moe_model(8, 40, 36, wtype="float16", htype="float16", top_k=2, normalize=1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 36)).astype(np.float16)
    logits = rng.standard_normal((5, 8)).astype(np.float16)
    y, mask = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})
    assert y.dtype == np.float16
    ref, ref_mask = moe_reference(x.astype(np.float32), logits.astype(np.float32), *w, top_k=2, normalize=1)
    assert np.array_equal(mask, ref_mask)
    assert _relative_error(y, ref) < 2e-3  # the output's own fp16 rounding


@pytest.mark.parametrize("tokens", [1, 64])
def test_threads_do_not_change_the_result(ort_lib, tokens):
    # Phase 2 adds experts in the same order whatever the threads: bitwise equal.
    model, _ = moe_model(16, 200, 136, top_k=4, normalize=1)
    feeds = ort_moe.random_feeds(np.random.default_rng(6), tokens, 136, 16)
    assert ort_moe.same_at_one_and_two_threads(ort_lib, model, feeds)


# Tokens per expert at every boundary of the GEMM's token groups (3 per block: 1..9, 15, 16, 17) with k and row
# tails (H 36, F 43), each weight dtype: top_k = E runs every expert on every token (x used in place when aligned),
# top-2 of 8 on its routed tokens (gathered). The input also comes in at an address 4 bytes past a 32-byte
# boundary (the kernel then gathers it onto a cache line): bitwise the same result.
@pytest.mark.parametrize("wtype", ["float32", "float16", "bfloat16"])
def test_token_counts_at_kernel_boundaries(ort_lib, wtype):
    rng = np.random.default_rng(11)
    for experts, top_k in ((4, 4), (8, 2)):
        model, w = moe_model(experts, 43, 36, wtype=wtype, top_k=top_k, normalize=1)
        sess = session(ort_lib, model)
        for tokens in (*range(1, 10), 15, 16, 17):
            x = rng.standard_normal((tokens, 36)).astype(np.float32)
            logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
            ref, ref_mask = moe_reference(x, logits, *w, top_k=top_k, normalize=1)
            y, mask, y_shifted = ort_moe.run_aligned_and_unaligned(sess, x, logits)
            where = f"E{experts} top_k={top_k} {wtype} T={tokens}"
            assert np.array_equal(mask, ref_mask), where
            assert _relative_error(y, ref.astype(np.float64)) <= 1e-5, where
            assert np.array_equal(y, y_shifted), where


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(activation="tanh"), "activation='tanh' is not implemented"),
        (dict(scoring="sparsemax"), "scoring='sparsemax' is not implemented"),
        (dict(normalize=2), "normalize=2"),
        (dict(top_k=9), "top_k=9 > 8 experts"),
        (dict(top_k=0), "top_k=0"),
        (dict(zeroing_threshold=-0.5), "zeroing_threshold"),
        (dict(weight_types=("float32", "float16", "float32")), "different element types"),
        (dict(weight_types=("float64",) * 3), "float32, float16 or bfloat16"),
        (dict(extra_inputs=5, threshold_input=True), "input size 11"),  # the schema: at most 10
    ],
)
def test_session_creation_refuses(ort_lib, kwargs, message):
    model, _ = moe_model(8, 40, 36, **kwargs)
    with pytest.raises(Exception) as info:
        session(ort_lib, model)
    text = str(info.value)
    assert message in text and "layers.0.moe/MoE" in text


def test_weights_are_not_copied(ort_lib, tmp_path):
    # A 96 MB model from a file with external data: the session's peak RSS stays within weights + 10 %.
    model, _ = moe_model(32, 512, 512, top_k=2, normalize=1)
    grown, weights = ort_moe.peak_rss_growth(ort_lib, model, tmp_path)
    assert grown <= 1.1 * weights, f"peak RSS grew {grown / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights"


def _huge_pages_after_session(lib: Path, model: onnx.ModelProto, **env: str) -> int:
    """Bytes of anonymous huge pages a session creation added to a fresh process (/proc/self/smaps_rollup)."""
    script = textwrap.dedent(
        f"""
        import re, sys, onnxruntime as ort
        def huge():
            text = open("/proc/self/smaps_rollup").read()
            return int(re.search(r"AnonHugePages:\\s+(\\d+) kB", text).group(1)) * 1024
        data = open(sys.argv[1], "rb").read()
        o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.register_custom_ops_library({str(lib)!r})
        before = huge()
        s = ort.InferenceSession(data, o, providers=["CPUExecutionProvider"])
        print(huge() - before)
        """
    )
    path = BUILD_DIR / "huge_pages_model.onnx"
    path.write_bytes(model.SerializeToString())
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env=ort_moe.script_env(**env),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_weights_are_backed_by_huge_pages_in_place(ort_lib):
    # The kernel collapses the expert weights ONNX Runtime holds into 2 MB pages (MADV_COLLAPSE, Linux 6.1) at
    # session creation: 3 tensors of 8 MB hold at least 3 whole aligned 2 MB blocks each; off with
    # LAYERZERO_ORT_HUGEPAGES=0. (In place: test_weights_are_not_copied bounds the RSS.)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine (/sys/kernel/mm/transparent_hugepage/enabled)")
    release = tuple(int(p) for p in os.uname().release.split(".")[:2] if p.isdigit())
    if release < (6, 1):
        pytest.skip(f"Linux {os.uname().release} has no MADV_COLLAPSE (6.1+): the weights keep their small pages")
    model, _ = moe_model(8, 512, 512, top_k=2, normalize=1)
    on = _huge_pages_after_session(ort_lib, model)
    off = _huge_pages_after_session(ort_lib, model, LAYERZERO_ORT_HUGEPAGES="0")
    assert on >= 9 * (2 << 20), f"{on / 2**20:.0f} MB of huge pages after the session (expected >= 18 MB)"
    assert off < 2 << 20, f"LAYERZERO_ORT_HUGEPAGES=0 still gave {off / 2**20:.0f} MB of huge pages"


def test_stream_read_reads_every_element(ort_lib):
    # bench/moe.py's stream column: the kernels' read pattern over regions, no arithmetic; the sum it returns
    # shows every float of every region was read (small integers: the float32 sum is exact in any order).
    import ctypes

    fn = ctypes.CDLL(str(ort_lib)).LayerZeroOrtStreamRead
    fn.restype = ctypes.c_float
    rng = np.random.default_rng(0)
    regions = [rng.integers(-4, 5, size=n).astype(np.float32) for n in (1, 7, 33, 4096, 100_003)]
    ptrs = (ctypes.c_void_p * len(regions))(*[r.ctypes.data for r in regions])
    sizes = (ctypes.c_int64 * len(regions))(*[r.nbytes for r in regions])
    assert fn(ptrs, sizes, len(regions)) == float(sum(r.sum() for r in regions))
    assert fn(ptrs, sizes, 0) == 0.0


def test_portable_kernels_match_reference(ort_lib):
    # LAYERZERO_ORT_ISA=generic: the baseline build of the row-dot kernels (machines without AVX2).
    proc = subprocess.run(
        [sys.executable, __file__, str(ort_lib), "--quick", "--expect-isa", "generic"],
        capture_output=True,
        text=True,
        env=ort_moe.script_env(LAYERZERO_ORT_ISA="generic"),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_address_sanitizer(ort_lib_asan):
    # The ASan build under the whole matrix (the Python process preloads libasan; its own leaks are not ours).
    proc = ort_moe.run_under_asan(__file__, ort_lib_asan)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_missing_library_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(PluginError) as info:
        ort_library.register(ort.SessionOptions(), [ort_library.ORT_LIBRARY])
    text = str(info.value)
    assert "\n" not in text and "liblayerzero_ort.so not found" in text and "layerzero plugins build" in text


# ------------------------------------------------------------------------------------- moe_op_v2 in the kernel


def _v2_reference(*params: str):
    """``plugins/reference.py``'s ``moe_reference`` when it takes the v2 ``params`` (else skip: the router and
    experts branches bring them); looked up at call time."""
    from layerzero.plugins import reference

    missing = sorted(set(params) - set(inspect.signature(reference.moe_reference).parameters))
    if missing:
        pytest.skip(f"plugins/reference.py's moe_reference has no {', '.join(missing)} (moe_op_v2 not merged here)")
    return reference.moe_reference


def moe_model_v2(
    experts: int,
    ffn: int,
    hidden: int,
    *,
    biases: tuple[str | None, str | None, str | None] = (None, None, None),
    score_bias: np.ndarray | None = None,
    threshold_input: bool = True,
    seed: int = 0,
    **attrs: object,
) -> tuple[onnx.ModelProto, list[np.ndarray], dict[str, np.ndarray | None]]:
    """The v2 layout: inputs 5-8 (b_gate, b_up, b_down, score_bias; "" = absent) and the threshold at 9.
    ``biases``: the dtype of each bias, None = absent. Returns the model, the weights, the v2 inputs as read."""
    model, w = moe_model(experts, ffn, hidden, seed=seed, **attrs)
    graph = model.graph
    rng = np.random.default_rng(seed + 100)
    names, extra = ["hidden", "logits", "w_gate", "w_up", "w_down"], {}
    for key, shape, dtype in zip(("b_gate", "b_up", "b_down"), ((experts, ffn),) * 2 + ((experts, hidden),), biases):
        extra[key] = None
        if dtype is None:
            names.append("")
            continue
        tensor, values = _weight_tensor(key, (rng.standard_normal(shape) * 0.5).astype(np.float32), dtype)
        graph.initializer.append(tensor)
        names.append(key)
        extra[key] = values
    extra["score_bias"] = score_bias
    if score_bias is None:
        names.append("")
    else:
        graph.initializer.append(numpy_helper.from_array(score_bias.astype(np.float32), "score_bias"))
        names.append("score_bias")
    if threshold_input:
        graph.input.append(helper.make_tensor_value_info(THRESHOLD, TensorProto.FLOAT, []))
        names.append(THRESHOLD)
    while names[-1] == "":
        names.pop()
    del graph.node[0].input[:]
    graph.node[0].input.extend(names)
    return model, w, extra


_GROUPED = dict(n_group=4, topk_group=2)


@pytest.mark.parametrize(
    "routing",
    [
        dict(score_bias=True),
        dict(**_GROUPED),
        dict(score_bias=True, **_GROUPED, routed_scaling_factor=2.5),
        dict(routed_scaling_factor=0.5),
        dict(score_bias=True, **_GROUPED, scoring="softmax", normalize=0),
    ],
    ids=["score_bias", "groups", "deepseek_v3", "scaling", "softmax_groups"],
)
def test_v2_routing_matches_reference(ort_lib, routing):
    # DeepSeek-V3's router: sigmoid scores, + e_score_correction_bias for the choice only, groups of experts
    # scored by their top-2 sum, the topk_group best kept, the unbiased scores renormalised and scaled.
    reference = _v2_reference("score_bias", "n_group", "topk_group", "routed_scaling_factor")
    routing = dict(routing)
    experts, ffn, hidden = 16, 43, 64
    rng = np.random.default_rng(11)
    bias = (rng.standard_normal(experts) * 0.3).astype(np.float32) if routing.pop("score_bias", False) else None
    attrs = dict(dict(scoring="sigmoid", normalize=1, top_k=4), **routing)
    model, w, _ = moe_model_v2(experts, ffn, hidden, score_bias=bias, **attrs)
    sess = session(ort_lib, model)
    for threshold in (0.0, 0.3):
        for tokens in (0, 1, 37):
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)
            logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
            feeds = {"hidden": x, "logits": logits, THRESHOLD: np.array(threshold, np.float32)}
            y, mask = sess.run(None, feeds)
            ref, ref_mask = reference(x, logits, *w, score_bias=bias, zeroing_threshold=threshold, **attrs)
            assert np.array_equal(mask, ref_mask), f"T={tokens} thr={threshold}: mask differs"
            assert _relative_error(y, ref) <= 1e-5, f"T={tokens} thr={threshold}"
    if bias is not None:  # the bias really changes the choice on these inputs (else the test proves nothing)
        unbiased, _, _ = moe_model_v2(experts, ffn, hidden, **attrs)
        x = rng.standard_normal((64, hidden)).astype(np.float32)
        logits = rng.standard_normal((64, experts)).astype(np.float32) * 2
        feeds = {"hidden": x, "logits": logits, THRESHOLD: np.array(0.0, np.float32)}
        assert not np.array_equal(sess.run(None, feeds)[1], session(ort_lib, unbiased).run(None, feeds)[1])


@pytest.mark.parametrize(
    ("biases", "activation"),
    [
        (("float32", "float32", "float32"), dict(activation="silu")),
        (("float32", None, "float16"), dict(activation="gelu")),
        (("float32", "float32", "float32"), dict(activation="swiglu_oai")),
        ((None, None, None), dict(activation="swiglu_oai", activation_alpha=1.5, activation_limit=0.8)),
        (("bfloat16", "bfloat16", None), dict(activation="swiglu_oai", activation_limit=float("inf"))),
    ],
    ids=["silu_biases", "gelu_some_biases", "gpt_oss", "swiglu_clamped", "swiglu_no_clamp"],
)
@pytest.mark.parametrize("wtype", ["float32", "float16"])
def test_v2_expert_biases_and_swiglu_match_reference(ort_lib, biases, activation, wtype):
    reference = _v2_reference("b_gate", "b_up", "b_down", "activation_alpha", "activation_limit")
    experts, ffn, hidden = 8, 40, 36
    attrs = dict(top_k=2, normalize=1, **activation)
    model, w, extra = moe_model_v2(experts, ffn, hidden, biases=biases, wtype=wtype, **attrs)
    sess = session(ort_lib, model)
    rng = np.random.default_rng(12)
    for tokens in (0, 1, 37):
        x = (rng.standard_normal((tokens, hidden)) * 3).astype(np.float32)  # large enough to reach the clamp
        logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
        y, mask = sess.run(None, {"hidden": x, "logits": logits, THRESHOLD: np.array(0.0, np.float32)})
        kwargs = {k: v for k, v in extra.items() if k != "score_bias" and v is not None}
        ref, ref_mask = reference(x, logits, *w, **kwargs, **attrs)
        assert np.array_equal(mask, ref_mask)
        assert _relative_error(y, ref) <= 1e-5, f"T={tokens}"


def test_v2_layout_without_threshold_and_old_layout_still_read(ort_lib):
    # v2 inputs without the threshold input (the attribute applies); and the 6-input v1 layout (threshold 5th)
    # is told apart from a node whose only v2 input is b_gate.
    model, _, _ = moe_model_v2(8, 40, 36, biases=("float32", None, None), threshold_input=False, top_k=2)
    assert len(model.graph.node[0].input) == 6 and model.graph.node[0].input[5] == "b_gate"
    x = np.random.default_rng(13).standard_normal((5, 36)).astype(np.float32)
    logits = np.random.default_rng(14).standard_normal((5, 8)).astype(np.float32)
    with_bias = session(ort_lib, model).run(None, {"hidden": x, "logits": logits})[0]
    plain = session(ort_lib, moe_model(8, 40, 36, top_k=2)[0]).run(None, {"hidden": x, "logits": logits})[0]
    assert not np.allclose(with_bias, plain)  # the bias was read, not taken for a threshold


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        (dict(n_group=3, topk_group=1), "n_group=3"),
        (dict(n_group=4, topk_group=5), "topk_group=5"),
        (dict(n_group=8, topk_group=1, top_k=2), "groups of 1 experts"),
        (dict(routing="sparsemixer"), "routing='sparsemixer'"),
        (dict(activation="swiglu"), "activation='swiglu'"),
    ],
)
def test_v2_session_creation_refuses(ort_lib, attrs, message):
    model, _, _ = moe_model_v2(8, 40, 36, biases=("float32", None, None), **dict(dict(top_k=1), **attrs))
    with pytest.raises(Exception) as info:
        session(ort_lib, model)
    assert message in str(info.value) and "layers.0.moe/MoE" in str(info.value)


# ------------------------------------------------------------------------------ lowering, bundle, runtime


def _compile(tmp_path, lowering: str, **config):
    from layerzero.compile import compile_model
    from layerzero.models.moe import MoEConfig, build_moe
    from layerzero.options import CompileOptions

    cfg = MoEConfig(**config)
    return cfg, compile_model(build_moe(cfg), CompileOptions(moe_lowering=lowering, atol=1e-5, rtol=1e-5))


@pytest.fixture
def native_dir(ort_lib, monkeypatch):
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(ort_lib.parent))
    return ort_lib.parent


@pytest.mark.parametrize(
    "config",
    [
        dict(experts=8, top_k=2, scoring="softmax", activation="silu"),
        dict(experts=8, top_k=2, scoring="sigmoid", activation="gelu", normalize=False),
    ],
)
def test_native_lowering_compiles_verifies_and_runs(native_dir, tmp_path, config):
    from layerzero.models.moe import moe_feeds
    from layerzero.runtime.bundle import write_bundle
    from layerzero.runtime.engine import Engine

    cfg, result = _compile(tmp_path, "native", **config)
    assert result.verification.passed
    moe = [n for n in result.model.graph if n.domain == "ai.layerzero"]
    assert len(moe) == 1 and len(moe[0].inputs) == 10 and moe[0].inputs[9].name == THRESHOLD  # _moe_node.py's slot
    assert not any(n.op_type == "If" for n in result.model.graph)
    bundle = write_bundle(tmp_path / "m.lz", result.model, {"target": "onnxruntime"})
    assert json.loads((bundle / "manifest.json").read_text())["libraries"] == ["liblayerzero_ort.so"]
    _, reference = _compile(tmp_path, "if", **config)
    ref_bundle = write_bundle(tmp_path / "r.lz", reference.model, {"target": "onnxruntime"})
    assert "libraries" not in json.loads((ref_bundle / "manifest.json").read_text())
    feeds = moe_feeds(cfg, 7, seed=3)
    native, via_if = Engine.load(bundle).run(feeds), Engine.load(ref_bundle).run(feeds)
    for name, value in via_if.outputs.items():
        np.testing.assert_allclose(native.outputs[name], value, rtol=1e-5, atol=1e-6)
    assert native.report.skipped_paths == via_if.report.skipped_paths


def test_bundle_without_the_library_fails_to_load_with_one_line(native_dir, tmp_path, monkeypatch):
    from layerzero.errors import UnsupportedModelError
    from layerzero.runtime.bundle import write_bundle
    from layerzero.runtime.engine import Engine

    _, result = _compile(tmp_path, "native", experts=4, top_k=2)
    bundle = write_bundle(tmp_path / "m.lz", result.model, {"target": "onnxruntime"})
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedModelError) as info:
        Engine.load(bundle)
    assert "\n" not in str(info.value) and "liblayerzero_ort.so not found" in str(info.value)


def test_triton_export_lists_the_op_library(native_dir, tmp_path):
    from layerzero.runtime.bundle import write_bundle
    from layerzero.runtime.triton_repo import export_triton_repository

    _, result = _compile(tmp_path, "native", experts=4, top_k=2)
    bundle = write_bundle(tmp_path / "m.lz", result.model, {"target": "onnxruntime"})
    export_triton_repository(bundle, tmp_path / "repo", no_reference=True)
    config = (tmp_path / "repo" / "layerzero_onnx" / "config.pbtxt").read_text()
    copied = (tmp_path / "repo" / "layerzero_onnx" / "1" / "liblayerzero_ort.so").resolve()
    assert copied.is_file()
    assert f'model_operations {{\n  op_library_filename: "{copied}"\n}}' in config


def test_auto_picks_native_only_when_built(native_dir, tmp_path, monkeypatch):

    _, result = _compile(tmp_path, "auto", experts=4, top_k=2)
    assert any(n.domain == "ai.layerzero" for n in result.model.graph)
    monkeypatch.setattr("layerzero.plugins.ort_library.find_ort_library", lambda *_a, **_k: None)
    _, result = _compile(tmp_path, "auto", experts=4, top_k=2)
    assert not any(n.domain == "ai.layerzero" for n in result.model.graph)
    assert any(n.op_type == "If" for n in result.model.graph)


def test_native_refuses_what_the_library_does_not_implement():
    import onnx_ir as ir

    from layerzero.passes import lower_moe_native
    from layerzero.passes.lower_moe import choose_lowering

    model, _ = moe_model(8, 40, 36, top_k=2, normalize=1)
    graph = ir.serde.deserialize_model(model).graph
    node = next(iter(graph))
    assert lower_moe_native.native_supports(node) is None
    node.attributes["expert_bias"] = ir.AttrFloat32s("expert_bias", [0.0] * 8)  # a variant of tomorrow
    assert "expert_bias" in lower_moe_native.native_supports(node)
    assert choose_lowering("native", "softmax", "silu", 0.0, node) in ("if", "ort-moe")
    del node.attributes["expert_bias"]
    node.attributes["activation"] = ir.AttrString("activation", "swish_beta")
    assert "swish_beta" in lower_moe_native.native_supports(node)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((8, 2, 1024, 4096, 1), "if"),  # few experts: If (measured, AUTO_CHOICE)
        ((64, 8, 1024, 512, 1), "if"),  # issue 11: If 3.1 ms, ort-moe 3.3 ms
        ((128, 8, 512, 256, 1), "ort-moe"),  # issue 11: If 1.87 ms (slower than the export), ort-moe 1.23 ms
        ((256, 8, 512, 256, 1), "ort-moe"),
    ],
)
def test_auto_cost_model_without_the_library(shape, expected, monkeypatch):
    import onnx_ir as ir

    from layerzero.passes import lower_moe_native

    experts, top_k, hidden, ffn, tokens = shape
    model, _ = moe_model(experts, 1, 1, top_k=top_k, normalize=1)  # real weights are not needed to price it
    node = next(iter(ir.serde.deserialize_model(model).graph))
    monkeypatch.setattr(
        lower_moe_native.BlockShape, "of", classmethod(lambda cls, n: cls(experts, top_k, hidden, ffn, tokens))
    )
    assert lower_moe_native.choose_auto(node, None, native_present=False) == expected
    assert lower_moe_native.choose_auto(node, "scoring 'sigmoid'", native_present=False) == "if"
    assert lower_moe_native.choose_auto(node, None, native_present=True) == "native"


def _main(argv: list[str]) -> int:
    return ort_moe.script_main(argv, "LayerZeroOrtIsa", "kernels", check_matrix)


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
