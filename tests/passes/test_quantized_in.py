"""Quantized models in (issue 22): the zeroing passes through MatMulNBits, weight-only QDQ and QMoE.

- a tiny Hugging Face Llama exported (``torch.onnx.export(dynamo=True)``), then quantized by ONNX Runtime's own
  ``MatMulNBitsQuantizer`` (4 bits, block 32, accuracy level 4, symmetric and not; its QOperator form
  ``MatMulNBits`` and its QDQ form ``DequantizeLinear`` (blocked int4) -> ``MatMul``), and an 8-bit weight-only
  QDQ form (``DequantizeLinear`` int8 per output channel -> ``MatMul``) written here;
- a declared zero flag removes its layer in every form; a pruned block of neurons (32 zero columns of layer 0's
  gate projection) is found through the quantization and removed (the projections' node shapes shrink); a
  single pruned neuron in a blocked int4 down projection cannot go exactly (not a whole block of K): the refusal
  says so; an all-zero MatMulNBits weight folds;
- ``com.microsoft::QMoE`` (int4 and int8 experts) rewritten to ``ai.layerzero::MoE`` with quantized experts.

Every compile verifies (compiled vs original on seeded inputs) and the tests compare with ONNX Runtime again.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.compile import compile_model
from layerzero.options import CompileOptions
from layerzero.passes import InferShapes, PropagateUniforms, RemoveDeadCode
from layerzero.passes._moe_node import MoENode
from layerzero.passes._quantized import quantized_weight
from layerzero.passes.structured_zeros import RemoveStructuredZeros

torch = pytest.importorskip("torch", reason="real-export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="real-export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
nbits = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer", reason="ORT's quantizer")

from tests.tiny_llama import export_logits, ort_logits, tiny_llama, token_feeds  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

VOCAB = 128
LAYERS = 2
ATOL = 1e-4
FORMS = ["nbits_sym", "nbits_asym", "qdq4_sym", "qdq4_asym", "qdq8"]
PRUNED = slice(32, 64)  # layer 0's gate columns (neurons) 32..63: one whole block of 32 of down's K


def _llama(prune: slice | None = None, seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(LAYERS, VOCAB, seed)
    if prune is not None:
        with torch.no_grad():
            model.model.layers[0].mlp.gate_proj.weight[prune] = 0.0  # [out, in]: neurons' gate columns
    return model


def _export(model: torch.nn.Module, path: Path) -> Path:
    return export_logits(model, path, VOCAB)


def _qdq8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """8-bit weight-only QDQ: each MatMul's constant [K, N] weight becomes DequantizeLinear(int8, scale[N], axis=1),
    symmetric per output channel (``s = max|w| / 127``, 0 for a zero column)."""
    inits = {t.name: t for t in proto.graph.initializer}
    nodes = []
    for node in proto.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
            w = onnx.numpy_helper.to_array(inits.pop(node.input[1])).astype(np.float32)
            scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
            q = np.where(scale > 0, np.rint(w / np.where(scale > 0, scale, 1)), 0).clip(-127, 127).astype(np.int8)
            name = node.input[1]
            inits[f"{name}_q8"] = onnx.numpy_helper.from_array(q, f"{name}_q8")
            inits[f"{name}_s8"] = onnx.numpy_helper.from_array(scale, f"{name}_s8")
            nodes.append(onnx.helper.make_node("DequantizeLinear", [f"{name}_q8", f"{name}_s8"], [f"{name}_dq8"],
                                               name=f"{node.name}_DQ8", axis=1))  # fmt: skip
            node.input[1] = f"{name}_dq8"
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(inits.values())
    return proto


def _quantize(source: Path, form: str, path: Path) -> Path:
    proto = onnx.load(str(source))
    if form == "qdq8":
        onnx.save(_qdq8(proto), str(path))
        return path
    fmt = nbits.QuantFormat.QOperator if form.startswith("nbits") else nbits.QuantFormat.QDQ
    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=32, is_symmetric=form.endswith("_sym"), accuracy_level=4, quant_format=fmt
    )
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    quantizer = nbits.MatMulNBitsQuantizer(proto, algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(path))
    return path


def _feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    return token_feeds(VOCAB, batch, seq, seed)


def _quantized_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph.all_nodes() if n.op_type in ("MatMulNBits", "DequantizeLinear")]


def _scope_nodes(model: ir.Model, prefix: str) -> list[ir.Node]:
    from layerzero.passes._graph import scope_of

    return [n for n in model.graph.all_nodes() if scope_of(n) == prefix or scope_of(n).startswith(prefix + ".")]


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _math_shape(model: ir.Model, projection: str, layer: int = 0) -> tuple[int, int]:
    """[K, N] of layer ``layer``'s quantized ``projection``. ONNX Runtime's quantizer drops the name scopes: the
    exporter's node names count the linears in order (``node_linear_<i>``, 7 per layer), its nodes keep them."""
    name = f"node_linear_{7 * layer + _PROJECTIONS.index(projection)}"
    for node in model.graph:
        if node.name != name and not node.name.startswith(name + "_"):
            continue
        weight = quantized_weight(node)
        if weight is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            weight = quantized_weight(node.inputs[1].producer())  # QDQ: the MatMul reads the DequantizeLinear
        if weight is not None:
            return weight.k, weight.n
    raise AssertionError(f"no quantized weight of {name}")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float exports (plain, layer 0 with a pruned block of neurons) and each quantized form of them."""
    tmp = tmp_path_factory.mktemp("quantized_in")
    out: dict[str, Path] = {}
    for kind, prune in (("plain", None), ("pruned", PRUNED), ("omitted", None)):
        model = _llama(prune)
        if kind == "omitted":  # the oracle of the flag: layer 1 deleted, the same weights otherwise
            model.model.layers = torch.nn.ModuleList([model.model.layers[0]])
            model.config.num_hidden_layers = 1
        source = _export(model, tmp / f"{kind}.onnx")
        for form in FORMS:
            out[f"{kind}_{form}"] = _quantize(source, form, tmp / f"{kind}_{form}.onnx")
        if kind == "plain":
            # The flag declared in the float export's metadata, then quantized (ORT's quantizer keeps the metadata;
            # an unread flag initializer it removes, as every unused initializer)
            proto = onnx.load(str(source))
            onnx.helper.set_model_props(proto, {"model.layers.1.flag": "0"})
            onnx.save(proto, str(tmp / "flagged.onnx"))
            for form in FORMS:
                out[f"flagged_{form}"] = _quantize(tmp / "flagged.onnx", form, tmp / f"flagged_{form}.onnx")
    return out


@pytest.mark.parametrize(
    "declared", ["metadata, then quantized", "initializer, after quantizing", "initializer, no value_info"]
)
@pytest.mark.parametrize("form", FORMS)
def test_declared_flag_removes_its_layer_through_the_quantization(
    exports: dict[str, Path], tmp_path: Path, form: str, declared: str
) -> None:
    scope = "model.layers.1"
    if declared.startswith("metadata"):
        path = exports[f"flagged_{form}"]
    else:
        proto = onnx.load(str(exports[f"plain_{form}"]))
        proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), f"{scope}.flag"))
        if declared.endswith("no value_info"):  # shapes past each MatMulNBits from InferShapes' stand-ins only
            del proto.graph.value_info[:]
        path = tmp_path / "flagged.onnx"
        onnx.save(proto, str(path))
    original = ir.load(path)
    before = len(_quantized_nodes(original))
    assert before >= 7 * LAYERS  # q, k, v, o, gate, up, down of each layer (+ lm_head)

    result = compile_model(path, CompileOptions(atol=ATOL, rtol=0))

    assert [b.scope for b in result.pipeline.bypassed] == [scope]
    assert _scope_nodes(result.model, scope) == []
    after = _quantized_nodes(result.model)
    assert len(after) == before - 7, Counter(n.op_type for n in after)  # the layer's 7 projections, still quantized
    assert not any(n.op_type == "MatMul" and quantized_weight(n.inputs[1].producer()) is None
                   and n.inputs[1].const_value is not None for n in result.model.graph)  # fmt: skip
    v = result.verification
    assert v is not None and v.passed
    assert v.impact is not None and max(o.max_abs for o in v.impact) > 1e-3  # the layer did something
    for batch, seq in [(1, 1), (2, 16)]:
        feeds = _feeds(batch, seq)
        # ONNX Runtime's quantizer on the model without layer 1: the same codes for every other weight
        expected = ort_logits(exports[f"omitted_{form}"], feeds)
        np.testing.assert_allclose(ort_logits(result.model, feeds), expected, atol=ATOL)


@pytest.mark.parametrize("form", FORMS)
def test_pruned_neurons_are_found_through_the_quantization(exports: dict[str, Path], form: str) -> None:
    path = exports[f"pruned_{form}"]
    original = ir.load(path)
    assert _math_shape(original, "gate_proj") == (64, 128)
    assert _math_shape(original, "down_proj") == (128, 64)

    result = compile_model(path, CompileOptions(atol=ATOL, rtol=0))

    live = 128 - (PRUNED.stop - PRUNED.start)
    assert _math_shape(result.model, "gate_proj") == (64, live)
    assert _math_shape(result.model, "up_proj") == (64, live)
    assert _math_shape(result.model, "down_proj") == (live, 64)
    assert _math_shape(result.model, "down_proj", layer=1) == (128, 64)  # layer 1 is dense
    v = result.verification
    assert v is not None and v.passed
    for batch, seq in [(1, 1), (2, 16)]:
        feeds = _feeds(batch, seq)
        np.testing.assert_allclose(ort_logits(result.model, feeds), ort_logits(path, feeds), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------- unit graphs


def _mlp(tmp: Path, gate: np.ndarray, up: np.ndarray, down: np.ndarray, form: str) -> Path:
    """y = x + (silu(x @ gate) * (x @ up)) @ down, quantized by ONNX Runtime's quantizer (``form`` of FORMS)."""
    h = gate.shape[0]
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "w_gate"], ["g"], name="node_linear_4"),
        onnx.helper.make_node("Sigmoid", ["g"], ["sg"]),
        onnx.helper.make_node("Mul", ["g", "sg"], ["act"]),
        onnx.helper.make_node("MatMul", ["x", "w_up"], ["u"], name="node_linear_5"),
        onnx.helper.make_node("Mul", ["act", "u"], ["m"]),
        onnx.helper.make_node("MatMul", ["m", "w_down"], ["d"], name="node_linear_6"),
        onnx.helper.make_node("Add", ["x", "d"], ["logits"]),
    ]
    inits = [onnx.numpy_helper.from_array(a.astype(np.float32), n)
             for n, a in (("w_gate", gate), ("w_up", up), ("w_down", down))]  # fmt: skip
    graph = onnx.helper.make_graph(
        nodes,
        "mlp",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", h])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["T", h])],
        inits,
    )
    source = tmp / "mlp.onnx"
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    # The intermediate shapes as value_info, as exporters write them: onnx's shape inference does not know
    # com.microsoft ops, so nothing after a MatMulNBits would have a shape.
    onnx.save(onnx.shape_inference.infer_shapes(model), str(source))
    return _quantize(source, form, tmp / f"mlp_{form}.onnx")


def _weights(seed: int = 0, h: int = 64, f: int = 128) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.2, (h, f)), rng.normal(0, 0.2, (h, f)), rng.normal(0, 0.2, (f, h))


@pytest.mark.parametrize("form", ["nbits_sym", "qdq4_asym"])
def test_a_single_pruned_neuron_is_kept_in_blocked_int4_and_the_refusal_says_why(tmp_path: Path, form: str) -> None:
    gate, up, down = _weights()
    gate[:, 5] = 0.0  # one neuron: not a whole block of 32 of down's K
    path = _mlp(tmp_path, gate, up, down, form)
    model = ir.load(path)
    InferShapes()(model)
    zeros = RemoveStructuredZeros()
    assert not zeros(model).modified
    (line,) = zeros.refusals
    assert "node_linear_6" in line and "1 dead entries" in line and "not whole blocks of 32" in line, line
    assert _math_shape(model, "gate_proj") == (64, 128) and _math_shape(model, "down_proj") == (128, 64)


def test_a_single_pruned_neuron_goes_through_int8_per_channel_qdq(tmp_path: Path) -> None:
    gate, up, down = _weights()
    gate[:, 5] = 0.0  # per-output-channel scales: K slices freely
    path = _mlp(tmp_path, gate, up, down, "qdq8")
    result = compile_model(path, CompileOptions(atol=1e-5, rtol=0))
    assert _math_shape(result.model, "gate_proj") == (64, 127)
    assert _math_shape(result.model, "down_proj") == (127, 64)
    assert result.verification is not None and result.verification.passed


@pytest.mark.parametrize("form", ["nbits_sym", "nbits_asym", "qdq4_sym", "qdq8"])
def test_an_all_zero_quantized_weight_folds(tmp_path: Path, form: str) -> None:
    gate, up, down = _weights()
    down[:] = 0.0  # the whole MLP computes 0: y = x
    path = _mlp(tmp_path, gate, up, down, form)
    weight = quantized_weight(next(n for n in ir.load(path).graph if n.name.startswith("node_linear_6")))
    if weight is None:  # QDQ: the MatMul reads the DequantizeLinear
        mm = next(n for n in ir.load(path).graph if n.name.startswith("node_linear_6"))
        weight = quantized_weight(mm.inputs[1].producer())
    assert weight is not None and weight.all_zero() and not np.any(weight.dequantize())
    model = ir.load(path)
    InferShapes()(model)
    assert PropagateUniforms()(model).modified
    RemoveDeadCode()(model)
    assert not _quantized_nodes(model), Counter(n.op_type for n in model.graph)
    feeds = {"x": np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)}
    np.testing.assert_array_equal(_run(model, feeds), feeds["x"])


def test_dequantize_is_onnx_runtime_arithmetic(tmp_path: Path) -> None:
    """The reader's float weight equals ONNX Runtime's own dequantization, bit for bit, in every form."""
    gate, up, down = _weights(3)
    for form in FORMS:
        model = ir.load(_mlp(tmp_path, gate, up, down, form))
        for node in model.graph:
            if node.op_type != "DequantizeLinear":
                continue
            weight = quantized_weight(node)
            assert weight is not None, form
            (expected,) = _run_node(node)
            np.testing.assert_array_equal(weight.dequantize(), expected)
        for node in model.graph:
            if node.op_type == "MatMulNBits":
                weight = quantized_weight(node)
                assert weight is not None
                eye = np.eye(weight.k, dtype=np.float32)  # A = I: the output is the dequantized weight
                (expected,) = _run_node(node, eye)
                np.testing.assert_allclose(weight.dequantize(), expected, rtol=0, atol=0)


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    proto = ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _run_node(node: ir.Node, a: np.ndarray | None = None) -> list[np.ndarray]:
    """ONNX Runtime's output of ``node`` alone (its constant inputs as initializers; ``a`` as MatMulNBits' A)."""
    inputs, inits = [], []
    for i, value in enumerate(node.inputs):
        if value is None:
            inputs.append("")
            continue
        if i == 0 and a is not None:
            inputs.append("a")
            continue
        inits.append(ir.to_proto(value.const_value))
        inits[-1].name = f"in{i}"
        inputs.append(f"in{i}")
    attrs = {k: v.value for k, v in node.attributes.items()}
    if "accuracy_level" in attrs:
        attrs["accuracy_level"] = 0  # float A: A = I reads the dequantized weight exactly (level 4 rounds A to int8)
    proto = onnx.helper.make_node(node.op_type, inputs, ["out"], domain=node.domain, **attrs)
    graph_inputs = []
    if a is not None:
        graph_inputs.append(onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, list(a.shape)))
    graph = onnx.helper.make_graph([proto], "one", graph_inputs, [onnx.ValueInfoProto(name="out")], inits)
    opsets = [onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a} if a is not None else {})


# ----------------------------------------------------------------------------------------------- QMoE

E, H, F, TOP_K = 8, 64, 64, 2


def _qmoe(bits: int, **kwargs) -> onnx.ModelProto:
    """One ``com.microsoft::QMoE`` of ``E`` experts, top ``TOP_K``, H x F (``layerzero.models.moe.build_qmoe``)."""
    from layerzero.models.moe import build_qmoe

    return build_qmoe(experts=E, hidden=H, ffn=F, top_k=TOP_K, bits=bits, **kwargs)


def _moe_feeds(tokens: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(tokens, H)).astype(np.float32),
            "logits": rng.normal(size=(tokens, E)).astype(np.float32)}  # fmt: skip


def _skip_experts(proto: onnx.ModelProto, quantized: bool | None = None):
    from layerzero.passes._moe import qmoe
    from layerzero.passes.moe import SkipExperts

    model = ir.from_proto(proto)
    InferShapes()(model)
    skip = SkipExperts()
    if quantized is None:
        result = skip(model)
    else:  # the rewrite with quantized experts forced on / off (the lowering of this build decides otherwise)
        from layerzero.passes._graph import NameFactory

        result = ir.passes.PassResult(model, qmoe.rewrite_qmoe(model, NameFactory(model.graph), 0.0, set(),
                                                               skip.rewritten, skip.rejected, quantized))  # fmt: skip
    return model, skip, result


def _moe_node(model: ir.Model) -> ir.Node:
    (node,) = [n for n in model.graph if n.op_type == "MoE" and n.domain == "ai.layerzero"]
    return node


@pytest.mark.parametrize(("bits", "accuracy"), [(4, 4), (8, 0)])
def test_qmoe_with_int8_activations_becomes_quantized_experts(bits: int, accuracy: int) -> None:
    """Block-wise QMoE that quantizes its activations to int8 (8-bit always, 4-bit at accuracy_level 4) becomes
    the skipping form with q4 / q8 experts: the same dequantized weights exactly, and the native op's output equal
    to ONNX Runtime's QMoE (float rounding apart)."""
    from layerzero.plugins.quant import dequantize_blocks
    from tests.plugins.native_build import build_ort_test_library

    proto = _qmoe(bits, accuracy=accuracy)
    model, skip, result = _skip_experts(proto, quantized=True)
    assert result.modified and skip.rewritten == [("layers.0.moe", f"qmoe-q{bits}")], skip.rejected
    node = _moe_node(model)
    view = MoENode.of(node)
    assert (view.weight_format, view.block_size, view.top_k, view.normalize) == (f"q{bits}", 32, TOP_K, True)
    assert len(node.inputs) == 13 and node.inputs[9] is None
    # the codes and scales dequantize to QMoE's own weights (gate / up de-interleaved)
    fc1, fc2 = _qmoe_dequantized(proto, "fc1", "s1", bits), _qmoe_dequantized(proto, "fc2", "s2", bits)
    pairs = ((view.w_gate, view.s_gate, fc1[:, 0::2]), (view.w_up, view.s_up, fc1[:, 1::2]),
             (view.w_down, view.s_down, fc2))  # fmt: skip
    for value, scales, expected in pairs:
        assert scales.const_value.dtype == ir.DataType.FLOAT16
        got = dequantize_blocks(value.const_value.numpy(), scales.const_value.numpy(), bits)
        np.testing.assert_array_equal(got, expected)
    library = build_ort_test_library()
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.log_severity_level = 3
    compiled = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for tokens in (1, 7):
        feeds = _moe_feeds(tokens)
        (expected,) = original.run(["y"], feeds)
        got = compiled.run(["y"], feeds)[0]
        # both quantize x and h per block of 32 to int8 the same way: measured here <= 7.6e-6 at |y| <= 12 (1, 7,
        # 64 tokens, 2 seeds), where the float experts on the same weights are 2.6e-2 .. 1.25e-1 away from QMoE
        np.testing.assert_allclose(got, expected, atol=5e-5, rtol=1e-5)


def _qmoe_dequantized(proto: onnx.ModelProto, codes: str, scales: str, bits: int) -> np.ndarray:
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    c, s = inits[codes].astype(np.int32), inits[scales].astype(np.float32)
    if bits == 4:
        q = np.empty((*c.shape[:-1], c.shape[-1] * 2), np.int32)
        q[..., 0::2], q[..., 1::2] = c & 0x0F, c >> 4
        q -= 8
    else:
        q = c - 128
    e, n, k = q.shape
    block = k // s.shape[-1] if s.ndim == 3 else k
    return (q.reshape(e, n, k // block, block).astype(np.float32) * s.reshape(e, n, -1)[..., None]).reshape(e, n, k)


@pytest.mark.parametrize(
    "kwargs", [dict(bits=4, accuracy=0), dict(bits=8, block=None), dict(bits=4, accuracy=0, biases=True, oai=True)]
)
def test_qmoe_with_float_activations_compiles_to_float_experts(kwargs: dict) -> None:
    """QMoE that keeps float activations (4-bit below accuracy_level 4, per-row scales) becomes float experts,
    dequantized: compile verifies at the default tolerance and the outputs equal ONNX Runtime's QMoE."""
    proto = _qmoe(**kwargs)
    model, skip, _ = _skip_experts(proto)
    assert skip.rewritten == [("layers.0.moe", "qmoe-float")], skip.rejected
    view = MoENode.of(_moe_node(model))
    assert view.weight_format == "f" and view.w_gate.const_value.dtype == ir.DataType.FLOAT
    assert view.activation == ("swiglu_oai" if kwargs.get("oai") else "silu")

    compiled = compile_model(proto, CompileOptions())
    assert compiled.verification is not None and compiled.verification.passed
    assert not [n for n in compiled.model.graph.all_nodes() if n.op_type == "QMoE"]
    original = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for tokens in (1, 9):
        feeds = _moe_feeds(tokens, seed=tokens)
        (expected,) = original.run(["y"], feeds)
        got = _run_any(compiled.model, feeds)
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def _run_any(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    from layerzero.ort_runner import create_session

    session = create_session(ir.to_proto(model).SerializeToString(), device="cpu")
    return session.run(["y"], feeds)[0]


@pytest.mark.parametrize(
    ("kwargs", "quantized", "reason"),
    [
        (dict(bits=8), False, "this compile's MoE lowering runs no quantized experts"),
        (dict(bits=8, block=16), True, "blocks of 16 (a block of 32 would take two different scales)"),
        (dict(bits=4, activation="relu"), None, "activation_type 'relu': non-gated experts"),
    ],
)
def test_qmoe_the_rewrite_cannot_convert_is_left_and_the_refusal_says_why(kwargs, quantized, reason) -> None:
    proto = _qmoe(**kwargs)
    model, skip, result = _skip_experts(proto, quantized)
    assert not result.modified and skip.rewritten == []
    (refusal,) = skip.rejected
    assert refusal.kind == "moe" and refusal.path == "layers.0.moe" and reason in refusal.reason, refusal
    assert [n.op_type for n in model.graph] == ["QMoE"]


def test_qmoe_becomes_quantized_experts_by_default_now_the_native_lowering_reads_them() -> None:
    # The switch is the native lowering's attribute set (passes/lower_moe_native.py): with weight_format in it,
    # an int8 QMoE becomes q8 experts without forcing.
    model, skip, result = _skip_experts(_qmoe(bits=8))
    assert result.modified and skip.rewritten, skip.rejected
    assert MoENode.of(_moe_node(model)).weight_format == "q8"


@pytest.mark.parametrize("form", ["nbits_asym", "qdq4_sym", "qdq8"])
def test_zero_columns_and_whole_zero_blocks_of_rows_slice_a_quantized_weight(tmp_path: Path, form: str) -> None:
    """Cases 3 and 4 of RemoveStructuredZeros through the quantization: y = -(Relu(x) @ W) with W's first 16
    output columns zero (a pruned head: the MatMul narrows, a Pad puts the zeros back) and its first 32 input rows
    zero (one whole block of K: the MatMul reads a Slice of its input).

    NOTE: a Neg, not an Add, reads the MatMul: ONNX Runtime fuses a QDQ MatMul followed by an Add into a float
    Gemm, and a MatMul followed by a Pad into MatMulNBits (int8 activations at its default accuracy level 4), so
    with an Add the compiled model ran another ORT kernel than the original (1.2e-2 apart; verification refused
    it)."""
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.2, (64, 64))
    w[:, :16] = 0.0
    w[:32] = 0.0
    nodes = [
        onnx.helper.make_node("Relu", ["x"], ["r"]),
        onnx.helper.make_node("MatMul", ["r", "w"], ["p"], name="node_linear_0"),
        onnx.helper.make_node("Neg", ["p"], ["logits"]),
    ]
    tensor = onnx.helper.make_tensor_value_info
    x_info, y_info = tensor("x", onnx.TensorProto.FLOAT, ["T", 64]), tensor("logits", onnx.TensorProto.FLOAT, ["T", 64])
    weight = onnx.numpy_helper.from_array(w.astype(np.float32), "w")
    graph = onnx.helper.make_graph(nodes, "g", [x_info], [y_info], [weight])
    source = tmp_path / "heads.onnx"
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    onnx.save(onnx.shape_inference.infer_shapes(model), str(source))
    path = _quantize(source, form, tmp_path / f"heads_{form}.onnx")

    result = compile_model(path, CompileOptions(atol=1e-5, rtol=0))

    assert _math_shape(result.model, "q_proj") == (32, 48)  # node_linear_0
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Pad"] == 1 and ops["Slice"] == 1, ops
    assert result.verification is not None and result.verification.passed
    feeds = {"x": rng.normal(size=(5, 64)).astype(np.float32)}
    np.testing.assert_allclose(_run(result.model, feeds), _run(ir.load(path), feeds), atol=1e-5, rtol=0)


def test_constant_folding_keeps_a_dequantize_linear_weight(tmp_path: Path) -> None:
    """FoldConstants leaves DequantizeLinear of constants: folded, a QDQ model lost its quantization and its
    numbers (ORT fuses DQ -> MatMul into MatMulNBits; the folded float MatMul of the tiny Llama was 3.7e-3 away)."""
    from layerzero.passes import FoldConstants

    gate, up, down = _weights(5)
    model = ir.load(_mlp(tmp_path, gate, up, down, "qdq4_sym"))
    before = len(_quantized_nodes(model))
    assert before == 3
    InferShapes()(model)
    assert not FoldConstants()(model).modified
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert len(matmuls) == 3 and all(n.inputs[1].producer().op_type == "DequantizeLinear" for n in matmuls)


def test_qmoe_without_normalized_routing_is_left_as_onnx_runtime_renormalises_anyway() -> None:
    """ONNX Runtime 1.32's CPU QMoE gives the same output with ``normalize_routing_weights`` 0 and 1 (the schema:
    0 keeps the softmax weights); the skipping form would honour the 0, so the node is left, saying why."""
    unnormalized, normalized = _qmoe(4, accuracy=0, normalize=False), _qmoe(4, accuracy=0)
    feeds = _moe_feeds(5)
    outputs = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
               for p in (unnormalized, normalized)]  # fmt: skip
    np.testing.assert_array_equal(*outputs)  # when this fails, ONNX Runtime honours the 0: rewrite it again
    _model, skip, result = _skip_experts(unnormalized)
    assert not result.modified and "normalize_routing_weights=0" in skip.rejected[0].reason
    compiled = compile_model(unnormalized, CompileOptions())
    np.testing.assert_array_equal(_run_any(compiled.model, feeds), outputs[0])


def test_qmoe_quantizing_activations_in_blocks_of_64_is_left() -> None:
    """QMoE quantizes its int8 activations per block_size; the native kernels per 32 (measured 0.14 apart at 64)."""
    _model, skip, result = _skip_experts(_qmoe(4, block=64, accuracy=4), quantized=True)
    assert not result.modified and "int8 activations in blocks of 64" in skip.rejected[0].reason
    assert _skip_experts(_qmoe(4, block=64, accuracy=0))[1].rewritten == [("layers.0.moe", "qmoe-float")]


@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
def test_qmoe_with_int8_activations_stays_qmoe_under_a_lowering_without_quantized_experts(lowering: str) -> None:
    """Only the native kernel runs quantized experts: with another lowering the QMoE node stays as it is (it was
    rewritten to quantized experts that the If / com.microsoft.MoE lowering laid out as float MatMuls on uint8
    codes, a model ONNX Runtime refused)."""
    proto = _qmoe(8)
    compiled = compile_model(proto, CompileOptions(moe_lowering=lowering))
    assert compiled.verification is not None and compiled.verification.passed
    assert [n.op_type for n in compiled.model.graph] == ["QMoE"]
    feeds = _moe_feeds(3)
    (expected,) = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)
    np.testing.assert_array_equal(_run_any(compiled.model, feeds), expected)
    from layerzero.passes.moe import SkipExperts

    model = ir.from_proto(proto)
    InferShapes()(model)
    skip = SkipExperts(quantized_experts=False)
    assert not skip(model).modified and "runs no quantized experts" in skip.rejected[0].reason


def test_qmoe_with_one_zero_point_a_row_becomes_float_experts() -> None:
    """4-bit zero points with one scale a row are packed two a byte along N ([E, N / 2]); read along K's blocks
    they did not fit, and the node was left."""
    proto = _qmoe(4, block=None, zero_points=True)
    model, skip, _result = _skip_experts(proto)
    assert skip.rewritten == [("layers.0.moe", "qmoe-float")], skip.rejected
    feeds = _moe_feeds(6)
    (expected,) = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)
    np.testing.assert_allclose(_run_any(model, feeds), expected, atol=1e-5, rtol=1e-5)
