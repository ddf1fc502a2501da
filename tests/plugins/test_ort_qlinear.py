"""liblayerzero_ort.so's ``ai.layerzero::QLinear`` (the dense quantized linear of ``--linear-kernel native``) against
``plugins/quant.py``'s ``qdot_rows`` (the MoE experts' row arithmetic on the same codes), and the pass that writes it
(``passes/native_linear.py``: MatMulNBits → QLinear) on the graphs ``QuantizeWeights`` and ONNX Runtime's own
quantizer make.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.passes.native_linear import NativeLinear
from layerzero.passes.quantize_weights import QuantizeWeights
from layerzero.passes.shape_inference import InferShapes
from layerzero.plugins.quant import qdot_rows, quantize_blocks
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
