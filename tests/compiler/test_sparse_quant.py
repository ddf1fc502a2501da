"""Activation-sparse int4 / int8 (issues 22 x 23): ``QuantizeWeights`` on ``ai.layerzero::SparseLinear``.

- a tiny Llama (transformers, random weights) exported, ``SparsifyActivations(native=True)`` at seeded per-channel
  thresholds, then ``QuantizeWeights`` int4 / int8: every projection ``weight_format`` q4 / q8, the codes at input 1
  and the float16 scales at input 5 (``""`` at 4) are ``plugins/quant.py``'s ``quantize_k_blocks(W, bits)`` of the
  float weight (blocks of 32 along K: the same values as ``quantize_blocks(W, bits, 32, axis=0)``), a second run
  changes nothing;
- the library (``liblayerzero_ort.so``, built into build/ort-test) runs it: each node's output equals
  ``plugins/sparse.py``'s reference on its own codes and inputs bitwise (and its kept count exactly); the whole
  model's logits are ONNX Runtime's reference form (the masked projections, ``Where``) with the dequantized
  weights within the kernel's int8 rounding of the activations (2.5 % of the logits' range; the masks then agree
  on >= 99 % of the channels: an activation near its threshold may fall either side);
- thresholds 0 + q4 (the quantized-dense reference, ``quantized_dense_reference(compiled=...)``) holds the compiled
  model's codes bitwise, equals the compiled model at ``layerzero::activation_scale`` 0 (the same kernel: 1e-6),
  and the dense MatMuls on the dequantized weights within the int8 activation rounding; a reference already in
  the native form (a bisection checkpoint) is quantized to the same codes;
- refusals: ``--quant-block`` 64 / ``--quant-asymmetric`` (one line naming the option), K or N off the block (kept
  ``"f"``, in ``kept``), a compiled projection the reference lacks (``VerificationError``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.contract import ACTIVATION_SCALE_INPUT, MASK_PREFIX, SPARSE_LINEAR_OP
from layerzero.errors import InvalidInputError, VerificationError
from layerzero.options import CompileOptions
from layerzero.passes._graph import NameFactory, make_constant, scope_of
from layerzero.passes._quant_codes import SPARSE_TILE
from layerzero.passes.quantize_weights import (
    QuantizeWeights,
    as_dense_sparse_linear,
    dequantize_matrix,
    sparse_linear_codes,
    sparse_linear_formats,
)
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.sparsify_activations import SparsifyActivations, find_groups
from layerzero.plugins import quant
from layerzero.plugins.sparse import dense_weight, sparse_linear_reference

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from layerzero.compile import quantized_dense_reference  # noqa: E402
from tests.tiny_llama import prefill_feeds  # noqa: E402

LAYERS, HIDDEN, FFN, VOCAB = 2, 64, 128, 128
PROJECTIONS = 7 * LAYERS
NODES = 4 * LAYERS  # SparseLinear nodes: q/k/v and gate/up fused, o and down alone


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp("sparse_quant_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    return tmp / "m.onnx"


@pytest.fixture(scope="module")
def library() -> Path:
    from tests.plugins.native_build import build_ort_test_library

    return build_ort_test_library()


def _load(path: Path) -> ir.Model:
    model = ir.load(path)
    InferShapes()(model)
    return model


def _thresholds(model: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)  # around the inputs' typical magnitude (random weights, init range 0.2)
    return {g.name: (rng.uniform(0.2, 1.6, g.channels) * 0.4).astype(np.float32) for g in find_groups(model)}


def _feeds(seq: int = 7) -> dict[str, np.ndarray]:
    return prefill_feeds(VOCAB, LAYERS, seq, 3, head_dim=HIDDEN // 4)


def _run(model: ir.Model, feeds: dict[str, np.ndarray], library: Path | None = None) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if library is not None:
        options.register_custom_ops_library(str(library))
    proto = ir.to_proto(model)
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    accepted = {i.name for i in [*sess.get_inputs(), *sess.get_overridable_initializers()]}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in accepted})))


def _sparse_quantized(path: Path, bits: int, accuracy_level: int = 4) -> tuple[ir.Model, QuantizeWeights]:
    model = _load(path)
    assert SparsifyActivations(_thresholds(model), native=True)(model).modified
    InferShapes()(model)
    step = QuantizeWeights(bits, accuracy_level=accuracy_level)
    assert step(model).modified
    return model, step


def _sparse_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == SPARSE_LINEAR_OP]


def _float_weights(path: Path) -> dict[str, np.ndarray]:
    """projection scope -> its float weight [K, N] in the export."""
    return {scope_of(n): p for g in find_groups(_load(path)) for n, p in zip(g.projections, g.weights)}


def _dequantized(node: ir.Node) -> np.ndarray:
    fmt = node.attributes["weight_format"].value
    return dense_weight(node.inputs[1].const_value.numpy(), node.inputs[5].const_value.numpy(), fmt)


def _projections(node: ir.Node) -> list[str]:
    """The scopes of the MatMuls a SparseLinear node computes (a fused group's, in column order, or its path)."""
    fused = node.attributes.get("projections")
    return list(fused.value) if fused is not None else [node.attributes["path"].value]


def _by_projection(node: ir.Node, w: np.ndarray, widths: dict[str, int]) -> dict[str, np.ndarray]:
    """A node's ``[K, N]`` matrix cut into its projections' columns (``widths``: scope -> N)."""
    scopes = _projections(node)
    cuts = np.cumsum([widths[s] for s in scopes])[:-1]
    return dict(zip(scopes, np.split(w, cuts, axis=1)))


def _quantize_x(model: ir.Model, names: NameFactory, node: ir.Node) -> None:
    """Before the projection MatMul ``node``: its x rounded to int8 per 32 channels as the q8 / q4 kernels do
    (``plugins/sparse.py`` quantize_kept: ``d = max|x| / 127``, ``q = clip(round_half_even(x * (127 / max|x|)))``),
    as float ``q * d``, in plain ONNX ops; the MatMul then computes the kernels' sum up to float rounding order."""
    graph = model.graph
    x = node.inputs[0]

    def const(hint: str, a) -> ir.Value:
        return make_constant(graph, names, hint, np.asarray(a))

    opset = model.opset_imports.get("", 17)
    nodes = [ir.node("Shape", [x])]
    nodes.append(ir.node("Reshape", [x, const("qx.blocks", np.array([0, 0, -1, 32], np.int64))]))
    nodes.append(ir.node("Abs", [nodes[-1].outputs[0]]))
    if opset >= 18:
        amax = ir.node("ReduceMax", [nodes[-1].outputs[0], const("qx.axes", np.array([-1], np.int64))],
                       {"keepdims": 1})  # fmt: skip
    else:
        amax = ir.node("ReduceMax", [nodes[-1].outputs[0]], {"axes": [-1], "keepdims": 1})
    nodes.append(amax)
    positive = ir.node("Greater", [amax.outputs[0], const("qx.zero", np.float32(0))])
    ratio = ir.node("Div", [const("qx.127", np.float32(127)), amax.outputs[0]])
    inv = ir.node("Where", [positive.outputs[0], ratio.outputs[0], const("qx.zero0", np.float32(0))])
    scaled = ir.node("Mul", [nodes[1].outputs[0], inv.outputs[0]])
    rounded = ir.node("Round", [scaled.outputs[0]])
    clipped = ir.node("Clip", [rounded.outputs[0], const("qx.lo", np.float32(-127)), const("qx.hi", np.float32(127))])
    d = ir.node("Div", [amax.outputs[0], const("qx.d127", np.float32(127))])
    xq = ir.node("Mul", [clipped.outputs[0], d.outputs[0]])
    back = ir.node("Reshape", [xq.outputs[0], nodes[0].outputs[0]])
    nodes += [positive, ratio, inv, scaled, rounded, clipped, d, xq, back]
    for n in nodes:
        for o in n.outputs:
            o.name = names(f"{scope_of(node)}.qx")
    graph.insert_before(node, nodes)
    node.replace_input_with(0, back.outputs[0])


def _masked(path: Path) -> ir.Model:
    """The export in ONNX Runtime's reference form of the sparsity (Where-masked projections)."""
    model = _load(path)
    assert SparsifyActivations(_thresholds(model), native=False)(model).modified
    return model


def _with_weights(model: ir.Model, compiled: ir.Model, quantize_x: bool = True) -> ir.Model:
    """``model`` (float projections as MatMuls) with each projection's weight the compiled SparseLinear's dequantized
    codes and lm_head's the compiled MatMulNBits' (matched by scope); ``quantize_x``: each projection's x rounded
    to int8 as the kernel does (``_quantize_x``)."""
    widths = {scope_of(n): n.inputs[1].shape[1] for n in model.graph if n.op_type == "MatMul"}
    sparse = {s: w for n in _sparse_nodes(compiled) for s, w in _by_projection(n, _dequantized(n), widths).items()}
    nbits = {}
    for n in compiled.graph:
        if n.op_type == "MatMulNBits":
            a = {k: v.value for k, v in n.attributes.items()}
            nbits[scope_of(n)] = dequantize_matrix(n.inputs[1].const_value.numpy(), n.inputs[2].const_value.numpy(),
                                                   None, a["bits"], a["block_size"], a["K"], a["N"])  # fmt: skip
    names = NameFactory(model.graph)
    replaced = 0
    for node in model.graph:
        if node.op_type != "MatMul":
            continue
        w = sparse.get(scope_of(node), nbits.get(scope_of(node)))
        if w is not None:
            assert w.shape == tuple(node.inputs[1].shape)
            node.replace_input_with(1, make_constant(model.graph, names, f"{scope_of(node)}.dq", w))
            if quantize_x and scope_of(node) in sparse:
                _quantize_x(model, names, node)
            replaced += 1
    assert replaced == len(sparse) + len(nbits) == PROJECTIONS + 1
    return model


# ------------------------------------------------------------------------------------------------ the node layout


@pytest.mark.parametrize("bits", [4, 8])
def test_projections_become_q4_q8_with_the_kernels_codes(llama: Path, bits: int) -> None:
    model, step = _sparse_quantized(llama, bits)
    assert len(step.quantized["sparse_linear"]) == NODES and len(step.quantized["matmul"]) == 1  # lm_head
    assert step.kept == []
    floats = _float_weights(llama)
    nodes = _sparse_nodes(model)
    assert len(nodes) == NODES and sorted(s for n in nodes for s in _projections(n)) == sorted(floats)
    for node in nodes:
        assert node.attributes["weight_format"].value == f"q{bits}" and node.attributes["block_size"].value == 32
        assert len(node.inputs) == 6 and node.inputs[4] is None  # no bias: "" between
        _, w, t, scale, _, scales = node.inputs
        assert scale.name == ACTIVATION_SCALE_INPUT and t.const_value is not None
        weight = np.concatenate([floats[s] for s in _projections(node)], axis=1)
        want_codes, want_scales = quant.quantize_k_blocks(weight, bits)
        k, n = weight.shape
        assert w.const_value.numpy().shape == ((k, n) if bits == 8 else (k, n // 2))
        assert w.const_value.dtype == (ir.DataType.INT8 if bits == 8 else ir.DataType.UINT8)
        assert scales.const_value.dtype == ir.DataType.FLOAT16 and scales.const_value.numpy().shape == (k // 32, n)
        np.testing.assert_array_equal(w.const_value.numpy(), want_codes)
        np.testing.assert_array_equal(scales.const_value.numpy(), want_scales)
    # the float weights are gone; the graph is valid ONNX; a second run changes nothing
    originals = {n.inputs[1].name for g in find_groups(_load(llama)) for n in g.projections}
    assert len(originals) == PROJECTIONS and not originals & set(model.graph.initializers)
    onnx.checker.check_model(ir.to_proto(model))
    again = QuantizeWeights(bits)
    InferShapes()(model)
    assert not again(model).modified and again.quantized["sparse_linear"] == []
    assert {r.reason for r in again.kept} == {f"weight already q{bits}"}


def test_sparse_linear_codes_are_quantize_blocks_along_k() -> None:
    # The same codes and scales as quantize_blocks along K (MatMulNBits' blocks), stored input-major.
    w = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32)
    for bits in (4, 8):
        codes, scales = sparse_linear_codes(w, bits)
        assert codes.shape == ((64, 96) if bits == 8 else (64, 48)) and scales.shape == (2, 96)
        assert codes.dtype == (np.int8 if bits == 8 else np.uint8) and scales.dtype == np.float16
        want_codes, want_scales = quant.quantize_blocks(w, bits, 32, axis=0)  # [N, K(/2)], [N, K/32]
        np.testing.assert_array_equal(scales, want_scales.T)
        np.testing.assert_array_equal(quant.k_block_codes(codes, bits), quant.unpack_codes(want_codes, bits).T)
        np.testing.assert_array_equal(dense_weight(codes, scales, f"q{bits}"),
                                      quant.dequantize_blocks(want_codes, want_scales, bits, 32, axis=0))  # fmt: skip
    # q4: byte j of a 32-column block holds column j (low nibble) and j + 16 (high), code + 8
    codes, _ = sparse_linear_codes(w, 4)
    q = quant.k_block_codes(codes, 4)
    np.testing.assert_array_equal(codes[:, :16] & 15, q[:, :16] + 8)
    np.testing.assert_array_equal(codes[:, :16] >> 4, q[:, 16:32] + 8)
    # N > SPARSE_TILE (8192): column tiles of 8192, each a row-major [K, width] block (q4 width / 2 bytes a row),
    # one after the other: tile 0's rows first (4096 bytes each), then tile 1's (N - 8192 columns)
    tile = SPARSE_TILE
    assert tile == quant.K_TILE == 8192
    w = np.random.default_rng(3).normal(size=(64, tile + 64)).astype(np.float32)
    for bits, per_col in ((4, 2), (8, 1)):
        codes, _ = sparse_linear_codes(w, bits)
        rows, _ = sparse_linear_codes(w[:, :tile], bits)  # one tile: the plain rows
        tail, _ = sparse_linear_codes(w[:, tile:], bits)
        flat = codes.reshape(-1)
        np.testing.assert_array_equal(flat[: 64 * tile // per_col].reshape(64, -1), rows)
        np.testing.assert_array_equal(flat[64 * tile // per_col :].reshape(64, -1), tail)
        np.testing.assert_array_equal(quant.k_block_codes(codes, bits), quant.unpack_codes(quant.quantize_blocks(
            w, bits, 32, axis=0)[0], bits).T)  # fmt: skip
    # q4, a whole 64-byte chunk of a row (128 columns): byte 16 L + 4 q + m holds byte 4 L + m of its 32-column
    # block q (column 32 q + 4 L + m low, + 16 high); a row's last partial chunk (here bytes 64..79) in block order
    w = np.random.default_rng(4).normal(size=(32, 160)).astype(np.float32)
    codes, _ = sparse_linear_codes(w, 4)
    nib = quant.k_block_codes(codes, 4).astype(np.int16) + 8  # [32, 160]
    for b in range(4):
        for j in range(16):
            byte = codes[:, 16 * (j // 4) + 4 * b + j % 4]
            np.testing.assert_array_equal(byte & 15, nib[:, 32 * b + j])
            np.testing.assert_array_equal(byte >> 4, nib[:, 32 * b + 16 + j])
    np.testing.assert_array_equal(codes[:, 64:] & 15, nib[:, 128:144])


def _one_node(n: int, inputs: int = 4, k: int = 32) -> ir.Model:
    rng = np.random.default_rng(2)
    init = [onnx.numpy_helper.from_array(rng.normal(size=(k, n)).astype(np.float32), "w"),
            onnx.numpy_helper.from_array(np.full(k, 0.1, np.float32), "t"),
            onnx.numpy_helper.from_array(np.array(1.0, np.float32), "s"),
            onnx.numpy_helper.from_array(rng.normal(size=n).astype(np.float32), "b")]  # fmt: skip
    node = onnx.helper.make_node(SPARSE_LINEAR_OP, ["x", "w", "t", "s", "b"][:inputs], ["y", "kept"],
                                 domain="ai.layerzero", name="/model/layers.0/mlp/down_proj/SparseLinear",
                                 weight_format="f", block_size=32, path="model.layers.0.mlp.down_proj")  # fmt: skip
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", n]),
         onnx.helper.make_tensor_value_info("kept", onnx.TensorProto.INT64, ["T"])], init,
    )  # fmt: skip
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("ai.layerzero", 1)]
    return ir.from_proto(onnx.helper.make_model(graph, opset_imports=opsets))


def test_n_off_the_block_keeps_f_and_says_so() -> None:
    model = _one_node(48)
    step = QuantizeWeights(4)
    assert not step(model).modified
    (node,) = _sparse_nodes(model)
    assert node.attributes["weight_format"].value == "f" and len(node.inputs) == 4
    (kept,) = step.kept
    assert kept.kind == "sparse_linear" and "N=48 is not a multiple of the kernel's block 32" in kept.reason


def test_k_off_the_block_keeps_f_and_says_so() -> None:
    model = _one_node(64, k=48)
    step = QuantizeWeights(4)
    assert not step(model).modified
    (node,) = _sparse_nodes(model)
    assert node.attributes["weight_format"].value == "f" and len(node.inputs) == 4
    (kept,) = step.kept
    assert kept.kind == "sparse_linear" and "K=48 is not a multiple of the kernel's block 32" in kept.reason


def test_bias_kept_at_input_4_and_scales_at_5(library: Path) -> None:
    model = _one_node(64, inputs=5)
    w = model.graph.initializers["w"].const_value.numpy()
    bias = model.graph.initializers["b"].const_value.numpy()
    assert QuantizeWeights(8)(model).modified
    (node,) = _sparse_nodes(model)
    assert [v.name if v is not None else "" for v in node.inputs][:5] == ["x", node.inputs[1].name, "t", "s", "b"]
    x = np.random.default_rng(5).normal(size=(3, 32)).astype(np.float32)
    got = _run(model, {"x": x}, library)
    codes, scales = quant.quantize_k_blocks(w, 8)
    y, kept = sparse_linear_reference(x, codes, 0.1, 1.0, bias, scales, "q8")
    np.testing.assert_array_equal(got["y"], y)
    np.testing.assert_array_equal(got["kept"], kept)


@pytest.mark.parametrize(("kwargs", "needle"), [({"block": 64}, "blocks of 64"),
                                                 ({"symmetric": False}, "--quant-asymmetric")])  # fmt: skip
def test_other_block_or_zero_points_refused_naming_the_option(kwargs, needle) -> None:
    with pytest.raises(InvalidInputError) as info:
        QuantizeWeights(4, **kwargs)(_one_node(64))
    message = str(info.value)
    assert message.startswith("option quant_block / quant_symmetric") and needle in message and "\n" not in message
    assert "model.layers.0.mlp.down_proj" in message


# ------------------------------------------------------------------------------------------------ the numerics


@pytest.mark.parametrize("bits", [4, 8])
def test_each_node_equals_the_reference_on_its_codes_and_the_model_the_masked_projections(
    llama: Path, library: Path, bits: int
) -> None:
    model, _ = _sparse_quantized(llama, bits, accuracy_level=1)  # lm_head's MatMulNBits in fp32 (a float reference)
    nodes = _sparse_nodes(model)
    # every node's x and y a graph output: each node against plugins/sparse.py on its own inputs
    seen = {v.name for v in model.graph.outputs}
    for node in nodes:
        for value in (node.inputs[0], node.outputs[0], node.outputs[1]):
            if value.name not in seen:
                model.graph.outputs.append(value)
                seen.add(value.name)
    feeds = _feeds()
    got = _run(model, feeds, library)
    realized = []
    for node in nodes:
        x = got[node.inputs[0].name]
        t = node.inputs[2].const_value.numpy()
        fmt = node.attributes["weight_format"].value
        y, kept = sparse_linear_reference(x, node.inputs[1].const_value.numpy(), t, 1.0, None,
                                          node.inputs[5].const_value.numpy(), fmt)  # fmt: skip
        np.testing.assert_array_equal(got[node.outputs[0].name], y)  # the kernels' exact integer arithmetic
        np.testing.assert_array_equal(got[node.outputs[1].name], kept)
        realized.append(1 - kept.mean() / x.shape[-1])
    assert 0.1 < float(np.mean(realized)) < 0.9  # the thresholds really skip rows
    # the whole model: ONNX Runtime's reference form (Where-masked MatMuls) with the dequantized weights
    reference = _load(llama)
    assert SparsifyActivations(_thresholds(reference), native=False)(reference).modified
    want = _run(_with_weights(reference, model), feeds)  # x int8-rounded as the kernel does
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    for name in want:
        if name.startswith(MASK_PREFIX):
            np.testing.assert_array_equal(got[name], want[name])
    # without the int8 rounding of x (float activations): what the rounding costs this tiny random model
    floats = _run(_with_weights(_masked(llama), model, quantize_x=False), feeds)
    print(f"q{bits}: int8 x vs float x, logits max |diff| {np.abs(got['logits'] - floats['logits']).max():.3g} "
          f"of max |logit| {np.abs(floats['logits']).max():.3g}")
    print(f"q{bits}: logits max |diff| {np.abs(got['logits'] - want['logits']).max():.3g}, realized sparsity "
          f"{np.mean(realized):.3f} over {len(nodes)} projections")  # fmt: skip


def test_quantized_dense_reference_holds_the_codes_at_thresholds_zero(llama: Path, library: Path) -> None:
    compiled, _ = _sparse_quantized(llama, 4, accuracy_level=1)
    options = CompileOptions(weights="int4", quant_accuracy_level=1)
    reference = quantized_dense_reference(_load(llama), options, compiled=compiled)
    ref_nodes = {n.attributes["path"].value: n for n in _sparse_nodes(reference)}
    assert set(ref_nodes) == set(sparse_linear_formats(compiled)) and len(ref_nodes) == NODES
    for node in _sparse_nodes(compiled):
        ref = ref_nodes[node.attributes["path"].value]
        assert ref.attributes["weight_format"].value == "q4"
        np.testing.assert_array_equal(ref.inputs[2].const_value.numpy(), 0)  # thresholds 0: nothing skipped
        for i in (1, 5):
            np.testing.assert_array_equal(ref.inputs[i].const_value.numpy(), node.inputs[i].const_value.numpy())
    feeds = _feeds()
    ref_out = _run(reference, feeds, library)
    # = the compiled model with the activation scale 0 (dense), the same kernel on the same codes
    dense = _run(compiled, {**feeds, ACTIVATION_SCALE_INPUT: np.array(0, np.float32)}, library)
    np.testing.assert_allclose(ref_out["logits"], dense["logits"], rtol=1e-6, atol=1e-6)
    # = the dense MatMuls on the dequantized weights (plain ONNX Runtime)
    want = _run(_with_weights(_load(llama), compiled), feeds)  # x int8-rounded as the kernel does
    np.testing.assert_allclose(ref_out["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    print(f"thresholds 0 + q4: logits max |diff| vs dense dequantized MatMuls "
          f"{np.abs(ref_out['logits'] - want['logits']).max():.3g}")  # fmt: skip
    # without a compiled model the reference is MatMulNBits throughout (no SparseLinear)
    plain = quantized_dense_reference(_load(llama), options)
    assert _sparse_nodes(plain) == [] and sum(n.op_type == "MatMulNBits" for n in plain.graph) == PROJECTIONS + 1


def test_reference_without_a_compiled_projection_is_a_verification_error(llama: Path) -> None:
    compiled, _ = _sparse_quantized(llama, 4)
    alone = next(n for n in _sparse_nodes(compiled) if "projections" not in n.attributes)
    alone.attributes["path"] = ir.AttrString("path", "model.layers.9.mlp.up_proj")
    with pytest.raises(VerificationError, match=r"model\.layers\.9\.mlp\.up_proj"):
        quantized_dense_reference(_load(llama), CompileOptions(weights="int4"), compiled=compiled)


def test_as_dense_sparse_linear_only_the_paths_named(llama: Path) -> None:
    model = _load(llama)
    done = as_dense_sparse_linear(model, {"model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"})
    assert sorted(done) == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    assert len(_sparse_nodes(model)) == 2



def test_reference_already_in_the_native_form_is_quantized_as_compiled(llama: Path) -> None:
    # A model already holding the SparseLinear projections (a bisection checkpoint after SparsifyActivations): no
    # projection is "missing", QuantizeWeights quantizes them to the compiled codes.
    compiled, _ = _sparse_quantized(llama, 8)
    source = _load(llama)
    assert SparsifyActivations(_thresholds(source), native=True)(source).modified
    reference = quantized_dense_reference(source, CompileOptions(weights="int8"), compiled=compiled)
    assert set(sparse_linear_formats(reference).values()) == {"q8"}
    want = {n.attributes["path"].value: n for n in _sparse_nodes(compiled)}
    for node in _sparse_nodes(reference):
        np.testing.assert_array_equal(node.inputs[1].const_value.numpy(),
                                      want[node.attributes["path"].value].inputs[1].const_value.numpy())  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_pass_codes_equal_the_kernel_format(bits):
    # passes/ quantizes SparseLinear weights with its own rows quantizer (a pass imports no plugins/ module): the
    # codes and scales must be plugins/quant.py's quantize_k_blocks, the format the kernel and its reference read.
    from layerzero.passes.quantize_weights import sparse_linear_codes
    from layerzero.plugins.quant import quantize_k_blocks

    rng = np.random.default_rng(bits)
    for n in (128, 2048 + 96):  # one column tile; two, the second narrower (tiles of 2048 columns)
        w = (rng.standard_normal((96, n)) * rng.lognormal(size=(96, 1))).astype(np.float32)
        w[5] = 0
        got, got_scales = sparse_linear_codes(w, bits)
        want, want_scales = quantize_k_blocks(w, bits)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_scales.view(np.uint16), want_scales.view(np.uint16))


def test_sparse_linear_projections_of_fused_plain_and_malformed_nodes(llama: Path) -> None:
    from layerzero.passes.quantize_weights import sparse_linear_projections

    compiled, _ = _sparse_quantized(llama, 4)
    got = sparse_linear_projections(compiled)
    assert got["model.layers.0.self_attn.qkv"] == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert got["model.layers.0.mlp.gate_up"] == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert got["model.layers.0.mlp.down_proj"] == ("model.layers.0.mlp.down_proj",)
    assert len(got) == NODES and sum(len(v) for v in got.values()) == PROJECTIONS
    # a projections attribute of another type (a hand-made node) reads as absent: the node's path alone
    node = _one_node(64)
    (sparse,) = _sparse_nodes(node)
    sparse.attributes["projections"] = ir.AttrInt64("projections", 3)
    assert sparse_linear_projections(node) == {"model.layers.0.mlp.down_proj": ("model.layers.0.mlp.down_proj",)}
