"""liblayerzero_ort.so's ``ai.layerzero::QLinear`` (the dense quantized linear of ``--linear-kernel native``) against
``plugins/quant.py``'s ``qdot_rows`` (the MoE experts' row arithmetic on the same codes), and the pass that writes it
(``passes/native_linear.py``: MatMulNBits → QLinear) on the graphs ``QuantizeWeights`` and ONNX Runtime's own
quantizer make.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.passes.native_linear import NativeLinear
from layerzero.passes.quantize_weights import QuantizeWeights
from layerzero.passes.shape_inference import InferShapes
from layerzero.plugins.quant import chunk_q4_rows, qdot_rows, quantize_blocks
from tests.plugins.ort_moe import session

NODE = "layers.0.mlp.down_proj/QLinear"
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1), helper.make_opsetid("com.microsoft", 1)]


def _qlinear(codes, scales, bias=None, fmt="q4", x_shape=("T", None), **attrs) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    names = ["x", "codes", "scales"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        names.append("bias")
    K = scales.shape[1] * 32
    node = helper.make_node("QLinear", names, ["y"], domain="ai.layerzero", name=NODE, weight_format=fmt, **attrs)
    shape = [K if d is None else d for d in x_shape]
    graph = helper.make_graph(
        [node], "ql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def _weights(rng, K, N, bits):
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)  # the MatMul's B
    codes, scales = quantize_blocks(np.ascontiguousarray(w.T), bits)  # [N, K/2] / [N, K], [N, K/32]
    return w, codes, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_qdot_rows(ort_lib, bits, tokens, threads):
    rng = np.random.default_rng(bits * 10 + tokens)
    K, N = 320, 200  # K not a multiple of the kernels' 256-element padding; N not of their 64-row granule
    _, codes, scales = _weights(rng, K, N, bits)
    bias = rng.standard_normal(N).astype(np.float32)
    sess = session(ort_lib, _qlinear(codes, scales, bias, f"q{bits}"), threads)
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (tokens, N) and y.dtype == np.float32
    if tokens:
        ref = qdot_rows(codes, scales, bits, x) + bias
        scale = qdot_rows(codes, scales, bits, x, absolute=True) + np.abs(bias)
        assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-7)


@pytest.mark.parametrize("K", [512, 544, 1056, 2048])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunk16_matches_qdot_rows(ort_lib, K, tokens, threads):
    # q4 rows in 16-block chunks (code_layout chunk16: what NativeLinear writes): whole chunks, then the plain
    # blocks after them (544 = 17 blocks, 1056 = 33); the same arithmetic as the plain rows.
    rng = np.random.default_rng(K + tokens)
    N = 200
    _, codes, scales = _weights(rng, K, N, 4)
    bias = rng.standard_normal(N).astype(np.float32)
    model = _qlinear(chunk_q4_rows(codes), scales, bias, "q4", code_layout="chunk16")
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    (y,) = session(ort_lib, model, threads).run(None, {"x": x})
    ref = qdot_rows(codes, scales, 4, x) + bias
    scale = qdot_rows(codes, scales, 4, x, absolute=True) + np.abs(bias)
    assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-7)
    (plain,) = session(ort_lib, _qlinear(codes, scales, bias, "q4"), threads).run(None, {"x": x})
    assert np.all(np.abs(y - plain) <= 2e-6 * scale + 1e-7)


@pytest.mark.parametrize("code_byte", [0xFF, 0x00, 0x0F])
@pytest.mark.parametrize("x_value", [1.0, -1.0])
@pytest.mark.parametrize("layout", ["chunk16", "rows"])
def test_extreme_codes_and_x_sum_exactly(ort_lib, code_byte, x_value, layout):
    # Every nibble at an end of its range (0xFF: code +7, stored 15; 0x00: code -8, stored 0; 0x0F: both) against
    # x codes all +-127: the AVX2 kernels sum unsigned-nibble x x-code products in int16 lanes before widening (a
    # chunk half's 4 steps: 4 x 2 x 2 x 15 x 127 = 30480 at most). A kernel that summed more steps in int16 would
    # wrap here; the result is then far from the exact one (qdot_rows in float64 on the same codes).
    K, N = 2048, 64
    codes = np.full((N, K // 2), code_byte, np.uint8)
    scales = np.ones((N, K // 32), np.float16)
    stored = chunk_q4_rows(codes) if layout == "chunk16" else codes
    attrs = {"code_layout": "chunk16"} if layout == "chunk16" else {}
    x = np.full((1, K), x_value, np.float32)
    (y,) = session(ort_lib, _qlinear(stored, scales, None, "q4", **attrs), 1).run(None, {"x": x})
    ref = qdot_rows(codes, scales, 4, x)
    lo, hi = (code_byte & 15) - 8, (code_byte >> 4) - 8
    assert np.allclose(ref, x_value * K / 2 * (lo + hi), rtol=1e-6)  # x codes +-127 at d = 1/127: exact
    np.testing.assert_allclose(y, ref, rtol=1e-6)


def test_rank3_batched_equals_alone_at_any_threads(ort_lib):
    rng = np.random.default_rng(3)
    K, N = 256, 4096  # several row ranges at 2 threads
    _, codes, scales = _weights(rng, K, N, 4)
    model = _qlinear(codes, scales, x_shape=("B", "S", None))
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    outs = []
    for threads in (1, 2):
        sess = session(ort_lib, model, threads)
        (y,) = sess.run(None, {"x": x})
        assert y.shape == (2, 3, N)
        alone = np.stack([np.stack([sess.run(None, {"x": x[b, s][None, None]})[0][0, 0] for s in range(3)])
                          for b in range(2)])  # fmt: skip
        assert np.array_equal(y, alone)  # a token's row is the same alone or batched
        outs.append(y)
    assert np.array_equal(outs[0], outs[1])  # and at any thread count
    ref = qdot_rows(codes, scales, 4, x.reshape(-1, K)).reshape(2, 3, N)
    assert np.abs(outs[0] - ref).max() <= 1e-5 * np.abs(ref).max()


def test_zero_x_gives_the_bias(ort_lib):
    rng = np.random.default_rng(4)
    _, codes, scales = _weights(rng, 64, 32, 4)
    bias = rng.standard_normal(32).astype(np.float32)
    (y,) = session(ort_lib, _qlinear(codes, scales, bias)).run(None, {"x": np.zeros((2, 64), np.float32)})
    assert np.array_equal(y, np.broadcast_to(bias, (2, 32)))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("format", "weight_format='q2' is not implemented"),
        ("codes_type", "codes have element type int8; weight_format='q4' takes uint8"),
        ("scales_type", "scales must be float16, not float32"),
        ("scales_shape", "scales must be [N, K/32] = [32, 2], not [32, 1]"),
        ("x_dim", "x's last dimension 48 is not the codes' K = 64"),
        ("block", "block_size=64 is not implemented"),
        ("layout", "code_layout='tiles' is not implemented by liblayerzero_ort.so (rows, chunk16)"),
        ("layout_q8", "code_layout='chunk16' is a q4 layout, not one of weight_format='q8'"),
    ],
)
def test_refused_when_the_session_is_made(ort_lib, case, expected):
    rng = np.random.default_rng(5)
    _, codes, scales = _weights(rng, 64, 32, 4)
    kw: dict = {}
    if case == "format":
        kw["fmt"] = "q2"
    elif case == "codes_type":
        codes = codes.view(np.int8)
    elif case == "scales_type":
        scales = scales.astype(np.float32)
    elif case == "scales_shape":
        scales, kw["x_shape"] = scales[:, :1], ("T", 64)
    elif case == "x_dim":
        kw["x_shape"] = ("T", 48)
    elif case == "block":
        kw["block_size"] = 64
    elif case == "layout":
        kw["code_layout"] = "tiles"
    elif case == "layout_q8":
        _, codes, scales = _weights(rng, 64, 32, 8)
        kw["fmt"], kw["code_layout"] = "q8", "chunk16"
    with pytest.raises(Exception) as info:
        session(ort_lib, _qlinear(codes, scales, **kw))
    message = str(info.value)
    assert expected in message and NODE in message


def test_wrong_x_at_run_time_is_one_line(ort_lib):
    rng = np.random.default_rng(6)
    _, codes, scales = _weights(rng, 64, 32, 4)
    sess = session(ort_lib, _qlinear(codes, scales, x_shape=("T", "K")))
    with pytest.raises(Exception, match="x's last dimension is not the codes' K = 64"):
        sess.run(None, {"x": np.zeros((1, 32), np.float32)})


# ------------------------------------------------------------------------------------ several outputs (splits)


def _graph_model(nodes, inits, outputs, k, x_shape=("T", None)) -> onnx.ModelProto:
    shape = [k if d is None else d for d in x_shape]
    graph = helper.make_graph(
        nodes, "ql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def _qlinear_splits(codes, scales, splits, bias=None, fmt="q4", outputs=None) -> onnx.ModelProto:
    """One QLinear with ``splits``, outputs y0, y1, ... (``outputs`` of them: len(splits) unless given)."""
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    names = ["x", "codes", "scales"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        names.append("bias")
    count = 1 if splits is None or isinstance(splits, int) else len(splits)
    outs = [f"y{i}" for i in range(count if outputs is None else outputs)]
    attrs = {} if splits is None else {"splits": splits if isinstance(splits, int) else list(splits)}
    node = helper.make_node("QLinear", names, outs, domain="ai.layerzero", name=NODE, weight_format=fmt, **attrs)
    return _graph_model([node], inits, outs, scales.shape[1] * 32)


def _qlinear_separate(codes, scales, splits, bias=None, fmt="q4") -> onnx.ModelProto:
    """One QLinear per split, on the split's rows of codes / scales / bias: outputs y0, y1, ..."""
    nodes, inits, start = [], [], 0
    for i, n in enumerate(splits):
        part = slice(start, start + n)
        start += n
        inits += [
            numpy_helper.from_array(codes[part], f"codes{i}"),
            numpy_helper.from_array(scales[part], f"scales{i}"),
        ]
        names = ["x", f"codes{i}", f"scales{i}"]
        if bias is not None:
            inits.append(numpy_helper.from_array(bias[part], f"bias{i}"))
            names.append(f"bias{i}")
        nodes.append(helper.make_node("QLinear", names, [f"y{i}"], domain="ai.layerzero", name=f"{NODE}{i}",
                                      weight_format=fmt))  # fmt: skip
    return _graph_model(nodes, inits, [f"y{i}" for i in range(len(splits))], scales.shape[1] * 32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("splits", [(1024, 256, 256), (32, 96, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_splits_match_qdot_rows_and_separate_nodes(ort_lib, bits, tokens, splits, with_bias):
    rng = np.random.default_rng(bits * 100 + tokens * 10 + len(splits) + with_bias)
    K, N = 320, sum(splits)
    _, codes, scales = _weights(rng, K, N, bits)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    runs = []
    for threads in (1, 2):
        outs = session(ort_lib, _qlinear_splits(codes, scales, splits, bias, f"q{bits}"), threads).run(None, {"x": x})
        assert [o.shape for o in outs] == [(tokens, n) for n in splits]
        assert all(o.dtype == np.float32 for o in outs)
        runs.append(outs)
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))  # at any thread count
    separate = session(ort_lib, _qlinear_separate(codes, scales, splits, bias, f"q{bits}")).run(None, {"x": x})
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], separate, strict=True))  # as three nodes
    (whole,) = session(ort_lib, _qlinear(codes, scales, bias, f"q{bits}")).run(None, {"x": x})
    assert np.array_equal(np.concatenate(runs[0], axis=-1), whole)  # as one node of N columns
    if tokens:
        b = np.zeros(N, np.float32) if bias is None else bias
        ref = qdot_rows(codes, scales, bits, x) + b
        scale = qdot_rows(codes, scales, bits, x, absolute=True) + np.abs(b)
        y = np.concatenate(runs[0], axis=-1)
        assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-7)


_SPLIT_RUN = (
    "import sys, numpy as np, onnxruntime as ort\n"
    "o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.register_custom_ops_library(sys.argv[1])\n"
    "s = ort.InferenceSession(sys.argv[2], o, providers=['CPUExecutionProvider'])\n"
    "np.savez(sys.argv[4], *s.run(None, dict(np.load(sys.argv[3]))))\n"
)


def test_splits_do_not_depend_on_the_work_items(ort_lib, tmp_path):
    # LAYERZERO_ORT_SPARSE_SPLIT forces the number of work items (1, 3, 7; read once a process): items cut at the
    # outputs' boundaries, the same bits every time.
    rng = np.random.default_rng(11)
    splits = (32, 96, 200, 64)
    _, codes, scales = _weights(rng, 256, sum(splits), 4)
    onnx.save(_qlinear_splits(codes, scales, splits), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((3, 256)).astype(np.float32))
    runs = []
    for items in (1, 3, 7):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LAYERZERO_ORT_SPARSE_SPLIT=str(items))
        out = tmp_path / f"y{items}.npz"
        args = [str(ort_lib), str(tmp_path / "m.onnx"), str(tmp_path / "in.npz"), str(out)]
        subprocess.run([sys.executable, "-c", _SPLIT_RUN, *args], check=True, env=env, timeout=300)
        with np.load(out) as f:
            runs.append([f[f"arr_{i}"] for i in range(len(splits))])
    assert all(np.array_equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True))


@pytest.mark.parametrize(
    ("splits", "outputs", "expected"),
    [
        ((32, 96, 63), None, "splits [32, 96, 63] sum to 191, not the codes' N = 192"),
        ((32, 96, 65), None, "splits [32, 96, 65] sum to 193, not the codes' N = 192"),
        ((32, 0, 160), None, "splits must be positive, not [32, 0, 160]"),
        ((-32, 64, 160), None, "splits must be positive, not [-32, 64, 160]"),
        ((32, 96, 64), 2, "has 2 outputs; splits [32, 96, 64] gives 3"),
        (None, 2, "has 2 outputs; QLinear without splits has one (y)"),
        (192, None, "splits must be a list of ints (the outputs' columns), not one int"),
    ],
)
def test_splits_refused_when_the_session_is_made(ort_lib, splits, outputs, expected):
    rng = np.random.default_rng(12)
    _, codes, scales = _weights(rng, 64, 192, 4)
    with pytest.raises(Exception) as info:
        session(ort_lib, _qlinear_splits(codes, scales, splits, outputs=outputs))
    message = str(info.value).strip()
    assert expected in message and NODE in message and "\n" not in message


def test_splits_checked_at_run_time_when_n_is_unknown(ort_lib):
    rng = np.random.default_rng(13)
    _, codes, scales = _weights(rng, 64, 192, 4)
    model = _qlinear_splits(codes, scales, (32, 96, 63))
    graph = model.graph
    del graph.initializer[:]  # codes and scales as inputs of unknown N: the sum is checked when it runs
    graph.input.extend([helper.make_tensor_value_info("codes", TensorProto.UINT8, ["N", 32]),
                        helper.make_tensor_value_info("scales", TensorProto.FLOAT16, ["N", 2])])  # fmt: skip
    sess = session(ort_lib, model)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(Exception) as info:
        sess.run(None, {"x": x, "codes": codes, "scales": scales})
    message = str(info.value).strip()
    assert "splits [32, 96, 63] sum to 191, not the codes' N = 192" in message and "\n" not in message


# ------------------------------------------------------------------------------------------------- the pass


def _matmul_model(ws: list[np.ndarray], bias: np.ndarray | None = None) -> ir.Model:
    """x [T, K] through MatMuls of ws in a chain (the last one as a Gemm with a bias when given)."""
    nodes, inits, cur = [], [], "x"
    for i, w in enumerate(ws):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        out = f"h{i}" if i + 1 < len(ws) else "y"
        if bias is not None and i + 1 == len(ws):
            inits.append(numpy_helper.from_array(bias, "b"))
            nodes.append(helper.make_node("Gemm", [cur, f"w{i}", "b"], [out], name=f"layers.{i}/Gemm"))
        else:
            nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [out], name=f"layers.{i}/MatMul"))
        cur = out
    graph = helper.make_graph(
        nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", ws[0].shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", ws[-1].shape[1]])], inits,
    )  # fmt: skip
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))


def _ops(model: ir.Model) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in model.graph:
        key = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_pass_rewrites_quantize_weights_output(ort_lib, bits):
    rng = np.random.default_rng(7 + bits)
    ws = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in ((128, 96), (96, 64))]
    bias = rng.standard_normal(64).astype(np.float32)
    model = _matmul_model(ws, bias)
    InferShapes()(model)  # the quantization reads A's rank and dtype (compiler/pipeline.py does the same)
    QuantizeWeights(bits, 32, True, 4)(model)
    assert _ops(model) == {"com.microsoft::MatMulNBits": 2}
    step = NativeLinear()
    assert step(model).modified and step.kept == []
    assert _ops(model) == {"ai.layerzero::QLinear": 2}
    assert sorted(step.rewritten) == ["layers.0/MatMul_MatMulNBits", "layers.1/Gemm_MatMulNBits"]
    assert not NativeLinear()(model).modified  # idempotent
    names = {v.name for v in model.graph.initializers.values()}
    assert not any(n in names for n in ("w0", "w1")) and len(names) == 5  # 2 x (codes, scales) + the bias
    x = rng.standard_normal((3, 128)).astype(np.float32)
    (y,) = session(ort_lib, ir.to_proto(model)).run(None, {"x": x})
    h = qdot_rows(*quantize_blocks(np.ascontiguousarray(ws[0].T), bits), bits, x).astype(np.float32)
    ref = qdot_rows(*quantize_blocks(np.ascontiguousarray(ws[1].T), bits), bits, h) + bias
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (dict(accuracy_level=0), "accuracy_level is not 4"),
        (dict(symmetric=False), "zero points or g_idx"),
        (dict(block=64), "blocks of 32"),
    ],
)
def test_pass_keeps_what_qlinear_does_not_compute(options, why):
    rng = np.random.default_rng(9)
    model = _matmul_model([(rng.standard_normal((128, 64)) / 8).astype(np.float32)])
    kw = dict(block=32, symmetric=True, accuracy_level=4) | options
    QuantizeWeights(4, kw["block"], kw["symmetric"], kw["accuracy_level"])(model)
    step = NativeLinear()
    assert not step(model).modified
    assert _ops(model) == {"com.microsoft::MatMulNBits": 1}
    assert len(step.kept) == 1 and why in step.kept[0][1]


def test_pass_keeps_onnxruntime_quantizer_scales():
    """ONNX Runtime's own symmetric quantizer writes float32 scales float16 does not hold exactly: kept as they are
    (QLinear's scales are float16; a rounded scale would be another model)."""
    mq = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    rng = np.random.default_rng(10)
    proto = ir.to_proto(_matmul_model([(rng.standard_normal((128, 64)) / 8).astype(np.float32)]))
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer = mq.MatMulNBitsQuantizer(proto, algo_config=config)
    quantizer.process()
    model = ir.from_proto(quantizer.model.model)
    step = NativeLinear()
    assert not step(model).modified
    assert step.kept and "float16" in step.kept[0][1]


def _shared_x_model(rng, with_bias: bool) -> tuple[ir.Model, list[np.ndarray]]:
    """q, k, v = x @ wq, x @ wk, x @ wv (Gemms with biases when ``with_bias``) and o = z @ wo; a consumer of k
    (Relu) before v's node, s = Relu(k) + v; graph outputs q, s, v, o."""
    K = 64
    shapes = {"q": 96, "k": 32, "v": 32, "o": 64}
    ws = {n: (rng.standard_normal((K, c)) / 8).astype(np.float32) for n, c in shapes.items()}
    inits = [numpy_helper.from_array(w, f"w{n}") for n, w in ws.items()]

    def proj(n: str, src: str) -> onnx.NodeProto:
        if with_bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(shapes[n]).astype(np.float32), f"b{n}"))
            return helper.make_node("Gemm", [src, f"w{n}", f"b{n}"], [n], name=f"layers.0/{n}_proj/Gemm")
        return helper.make_node("MatMul", [src, f"w{n}"], [n], name=f"layers.0/{n}_proj/MatMul")

    nodes = [
        proj("q", "x"),
        proj("k", "x"),
        helper.make_node("Relu", ["k"], ["r"], name="relu"),
        proj("o", "z"),
        proj("v", "x"),
        helper.make_node("Add", ["r", "v"], ["s"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "qkv", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", K]) for n in ("x", "z")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", shapes.get(n, 32)]) for n in ("q", "s", "v", "o")],
        inits,
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    InferShapes()(model)
    return model, list(ws.values())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pass_merges_the_projections_of_one_x(ort_lib, monkeypatch, bits, with_bias):
    rng = np.random.default_rng(20 + bits + with_bias)
    model, _ = _shared_x_model(rng, with_bias)
    QuantizeWeights(bits, 32, True, 4)(model)
    assert _ops(model)["com.microsoft::MatMulNBits"] == 4
    unmerged = ir.from_proto(ir.to_proto(model))
    with monkeypatch.context() as m:  # the rewrite alone: one QLinear a projection
        m.setattr(NativeLinear, "_merge_all", lambda self, graph, names: None)
        NativeLinear()(unmerged)
    assert _ops(unmerged)["ai.layerzero::QLinear"] == 4

    step = NativeLinear()
    assert step(model).modified and step.kept == []
    assert _ops(model) == {"ai.layerzero::QLinear": 2, "Relu": 1, "Add": 1}
    qlinear = [n for n in model.graph if n.op_type == "QLinear"]
    merged = [n for n in qlinear if "splits" in n.attributes]
    assert len(merged) == 1 and list(merged[0].attributes["splits"].value) == [96, 32, 32]
    suffix = "Gemm_MatMulNBits" if with_bias else "MatMul_MatMulNBits"
    names = [f"layers.0/{p}_proj/{suffix}" for p in "qkv"]
    assert step.merged == [(names[0], names)] and merged[0].name == names[0]
    before_names = {n.name: n.outputs[0].name for n in unmerged.graph}
    assert [v.name for v in merged[0].outputs] == [before_names[n] for n in names]  # the values kept their names
    assert [v.name for v in merged[0].outputs][::2] == ["q", "v"]  # (k is QuantizeWeights' value, not an output)
    assert len(merged[0].inputs) == (4 if with_bias else 3)
    assert [v.name for v in model.graph.outputs] == ["q", "s", "v", "o"]
    order = [n.name for n in model.graph]
    assert order.index(names[0]) < order.index("relu")  # where q's node was: before k's consumer
    # the merged projections' own codes / scales / biases are gone: o's, and the merged node's
    assert len(model.graph.initializers) == (6 if with_bias else 4)

    again = NativeLinear()
    assert not again(model).modified and again.merged == [] and again.rewritten == []  # idempotent
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)  # topologically sorted
    rng2 = np.random.default_rng(1)
    feeds = {n: rng2.standard_normal((5, 64)).astype(np.float32) for n in ("x", "z")}
    for threads in (1, 2):
        got = session(ort_lib, proto, threads).run(None, feeds)
        before = session(ort_lib, ir.to_proto(unmerged), threads).run(None, feeds)
        assert all(np.array_equal(a, b) for a, b in zip(got, before, strict=True))


def test_pass_merges_only_alike_projections(ort_lib):
    # A bias on v's projection only: q and k merge, v stays alone (all with a bias or none).
    rng = np.random.default_rng(30)
    model, _ = _shared_x_model(rng, False)
    QuantizeWeights(4, 32, True, 4)(model)
    v_node = next(n for n in model.graph if n.name.startswith("layers.0/v_proj"))
    bias = ir.Value(name="bv", const_value=ir.tensor(np.ones(32, np.float32)))
    bias.dtype, bias.shape = ir.DataType.FLOAT, ir.Shape([32])
    model.graph.register_initializer(bias)
    v_node.resize_inputs(6)
    v_node.replace_input_with(5, bias)
    step = NativeLinear()
    step(model)
    assert step.merged == [
        ("layers.0/q_proj/MatMul_MatMulNBits", [f"layers.0/{p}_proj/MatMul_MatMulNBits" for p in "qk"])
    ]
    assert _ops(model)["ai.layerzero::QLinear"] == 3

    # QLinear nodes already there (three of one x): the two with constant codes merge, the one whose codes are a
    # graph input stays; the outputs are the same bits.
    _, codes, scales = _weights(rng, 64, 192, 4)
    proto = _qlinear_separate(codes, scales, (32, 96, 64))
    feeds = {"x": rng.standard_normal((3, 64)).astype(np.float32), "codes1": codes[32:128]}
    init = next(t for t in proto.graph.initializer if t.name == "codes1")
    proto.graph.initializer.remove(init)
    proto.graph.input.append(helper.make_tensor_value_info("codes1", TensorProto.UINT8, [96, 32]))
    before = session(ort_lib, proto).run(None, feeds)
    model = ir.from_proto(proto)
    step = NativeLinear()
    assert step(model).modified and step.merged == [(f"{NODE}0", [f"{NODE}0", f"{NODE}2"])]
    merged = next(n for n in model.graph if "splits" in n.attributes)
    assert list(merged.attributes["splits"].value) == [32, 64] and [v.name for v in merged.outputs] == ["y0", "y2"]
    assert sorted(model.graph.initializers) == [f"{NODE}0.merged_codes", f"{NODE}0.merged_scales", "scales1"]
    after = session(ort_lib, ir.to_proto(model)).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert not NativeLinear()(model).modified
