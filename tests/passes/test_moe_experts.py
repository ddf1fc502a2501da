"""The expert part's variants (issue 8 item 4): expert biases, GPT-OSS's clamped SwiGLU ``swiglu_oai``, fused
gate/up (interleaved or concatenated), transposed batched projections; matched by ``SkipExperts``, computed by
``plugins/reference.py`` and by the ``if`` and ``ort-moe`` lowerings, refused by the native kernel.

Graphs are built here the way the exporters write GPT-OSS's experts (``batched_mm``, ``is_transposed``,
``has_bias``): dynamo (``GatherND`` rows, ``Unsqueeze``/``Squeeze`` identity pairs) and TorchScript
(``Gather`` of the flat indices). Each compiled graph is compared with the original on seeded tokens (1 and 16).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

from layerzero.errors import UnsupportedModelError
from layerzero.passes._dynamic import MOE_DOMAIN, MOE_OP
from layerzero.passes.lower_moe import LowerMoE, ort_moe_supports
from layerzero.passes.lower_moe_native import native_supports
from layerzero.passes.moe import SkipExperts
from layerzero.plugins.reference import glu, moe_reference

E, K, H, F = 4, 2, 16, 12
LIMIT, ALPHA = 7.0, 1.702
TOKENS = (1, 16)
ATOL, RTOL = 1e-5, 1e-4
BIG = np.iinfo(np.int64).max


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return {
        "router": rng.normal(0, 1, (E, H)).astype(f32),
        "router_bias": rng.normal(0, 0.1, E).astype(f32),
        # [E, H, 2F], gate and up interleaved along the last axis (GPT-OSS); std 1: |gate| > 7 happens.
        "gate_up": rng.normal(0, 1.0, (E, H, 2 * F)).astype(f32),
        "gate_up_bias": rng.normal(0, 0.5, (E, 2 * F)).astype(f32),
        "down": rng.normal(0, 0.2, (E, F, H)).astype(f32),
        "down_bias": rng.normal(0, 0.5, (E, H)).astype(f32),
    }


def _c(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def gpt_oss_block(
    exporter: str = "dynamo",
    *,
    clamp: str = "both",  # "both" | "none" | "mismatch"
    alpha: float = ALPHA,
    layout: str = "interleaved",  # "interleaved" | "concatenated"
    biases: bool = True,
    overridable: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """One GPT-OSS MoE block ``y = experts(x)`` as an exporter writes it (router: Gemm + bias, TopK, Softmax)."""
    w = _weights(seed)
    gathers = "GatherND" if exporter == "dynamo" else "Gather"
    nodes, inits = [], []

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=f"/model/layers.0/mlp/experts/{out}", **attrs))
        return out

    def const(name: str, array) -> str:
        inits.append(_c(name, array))
        return name

    i64 = np.int64
    one, minus_one = const("one_axis", np.array([1], i64)), const("minus_one", np.array([-1], i64))
    logits = node(
        "Gemm", ["x", const("router.weight", w["router"]), const("router.bias", w["router_bias"])], "logits", transB=1
    )
    nodes.append(
        helper.make_node("TopK", [logits, const("k", np.array([K], i64))], ["vals", "idx"], axis=-1, name="topk")
    )
    probs = node("Softmax", ["vals"], "probs", axis=1)
    rep = node(
        "Reshape",
        [
            node("Expand", [node("Unsqueeze", ["x", one], "xu"), const("kk", np.array([1, K, 1], i64))], "xe"),
            const("to_rows", np.array([-1, H], i64)),
        ],
        "rep",
    )
    w_flat = node("Reshape", [probs, minus_one], "w_flat")
    i_flat = node("Reshape", ["idx", minus_one], "i_flat")
    index = node("Unsqueeze", [i_flat, minus_one], "rows") if exporter == "dynamo" else i_flat

    def pick(weight: str) -> str:
        return node(gathers, [weight, index], f"{weight}.picked", **({} if exporter == "dynamo" else {"axis": 0}))

    def projection(x: str, weight: str, bias: str | None, tag: str) -> str:
        mm = node("MatMul", [node("Unsqueeze", [x, one], f"{tag}.u"), pick(weight)], f"{tag}.mm")
        out = node("Squeeze", [mm, one], f"{tag}.sq")
        if bias is not None:
            out = node("Add", [out, pick(bias)], f"{tag}.biased")
        if exporter == "dynamo":  # the identity pair dynamo leaves
            out = node("Squeeze", [node("Unsqueeze", [out, one], f"{tag}.u2"), one], f"{tag}.sq2")
        return out

    gate_up = (
        w["gate_up"]
        if layout == "interleaved"
        else np.concatenate([w["gate_up"][..., ::2], w["gate_up"][..., 1::2]], -1)
    )
    gate_up_bias = (
        w["gate_up_bias"]
        if layout == "interleaved"
        else np.concatenate([w["gate_up_bias"][:, ::2], w["gate_up_bias"][:, 1::2]], -1)
    )
    if overridable:
        inits.append(_c("gate_up_proj", gate_up))
    else:
        const("gate_up_proj", gate_up)
    const("gate_up_proj_bias", gate_up_bias)
    const("down_proj", w["down"])
    const("down_proj_bias", w["down_bias"])
    fused = projection(rep, "gate_up_proj", "gate_up_proj_bias" if biases else None, "gate_up")
    if layout == "interleaved":
        step = const("step2", np.array([2], i64))
        gate = node(
            "Slice", [fused, const("start0", np.array([0], i64)), const("end", np.array([BIG], i64)), one, step], "gate"
        )
        up = node("Slice", [fused, one, "end", one, step], "up")
    else:
        nodes.append(
            helper.make_node(
                "Split", [fused, const("halves", np.array([F, F], i64))], ["gate", "up"], axis=-1, name="split"
            )
        )
        gate, up = "gate", "up"
    if clamp != "none":
        gate = node("Clip", [gate, "", const("limit", np.array(LIMIT, np.float32))], "gate_c")
        up_limit = LIMIT if clamp == "both" else LIMIT + 1.0
        up = node(
            "Clip",
            [
                up,
                const("neg_limit", np.array(-up_limit, np.float32)),
                const("up_limit", np.array(up_limit, np.float32)),
            ],
            "up_c",
        )
    scaled = gate if alpha == 1.0 else node("Mul", [gate, const("alpha", np.array(alpha, np.float32))], "scaled")
    glu_out = node("Mul", [gate, node("Sigmoid", [scaled], "sig")], "glu")
    h = node("Mul", [node("Add", [up, const("plus_one", np.array(1.0, np.float32))], "up1"), glu_out], "h")
    down = projection(h, "down_proj", "down_proj_bias" if biases else None, "down")
    weighted = node("Mul", [down, node("Unsqueeze", [w_flat, minus_one], "w_col")], "weighted")
    y = node(
        "ReduceSum",
        [node("Reshape", [weighted, const("to_slots", np.array([-1, K, H], i64))], "slots"), one],
        "y",
        keepdims=0,
    )
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])]
    if overridable:
        inputs.append(helper.make_tensor_value_info("gate_up_proj", TensorProto.FLOAT, list(gate_up.shape)))
    graph = helper.make_graph(
        nodes, "gpt_oss_block", inputs, [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["T", H])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).normal(0, 1, (n, H)).astype(np.float32)


def _skip(proto: onnx.ModelProto) -> tuple[ir.Model, SkipExperts, ir.passes.PassResult]:
    model = ir.from_proto(proto)
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    skip = SkipExperts()
    return model, skip, skip(model)


def _moe_node(model: ir.Model) -> ir.Node:
    nodes = [n for n in model.graph if n.domain == MOE_DOMAIN and n.op_type == MOE_OP]
    assert len(nodes) == 1
    return nodes[0]


def _lowered(proto: onnx.ModelProto, lowering: str) -> tuple[onnx.ModelProto, LowerMoE]:
    model, _, result = _skip(proto)
    assert result.modified
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    lower = LowerMoE(lowering=lowering, native_present=lowering == "native")
    lower(model)
    # The pipeline infers shapes after lowering (the mask output's type comes from there).
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    return ir.to_proto(model), lower


def _assert_same(original: onnx.ModelProto, compiled: onnx.ModelProto, tokens: int, seed: int = 0) -> None:
    x = _tokens(tokens, seed)
    (expected,) = _session(original).run(["y"], {"x": x})
    got = _session(compiled).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


# --- matching ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt_oss_block_is_rewritten_with_biases_and_swiglu_oai(exporter: str) -> None:
    proto = gpt_oss_block(exporter)
    before = len(proto.graph.node)
    model, skip, result = _skip(proto)
    assert result.modified and [form for _, form in skip.rewritten] == ["batched_mm"] and not skip.rejected
    node = _moe_node(model)
    attrs = {k: a.value for k, a in node.attributes.items()}
    assert attrs["activation"] == "swiglu_oai" and attrs["top_k"] == K and attrs["normalize"] == 1
    assert attrs["activation_alpha"] == pytest.approx(ALPHA) and attrs["activation_limit"] == pytest.approx(LIMIT)
    assert len(node.inputs) == 8 and all(v is not None for v in node.inputs)
    # De-interleaved at compile time: gate = columns 0, 2, 4, ..., up = 1, 3, 5, ... of gate_up [E, H, 2F].
    w = _weights()
    np.testing.assert_array_equal(node.inputs[2].const_value.numpy(), w["gate_up"][..., ::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(node.inputs[3].const_value.numpy(), w["gate_up"][..., 1::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(node.inputs[4].const_value.numpy(), w["down"].transpose(0, 2, 1))
    np.testing.assert_array_equal(node.inputs[5].const_value.numpy(), w["gate_up_bias"][:, ::2])
    np.testing.assert_array_equal(node.inputs[6].const_value.numpy(), w["gate_up_bias"][:, 1::2])
    np.testing.assert_array_equal(node.inputs[7].const_value.numpy(), w["down_bias"])
    # Router Gemm stays; TopK, Softmax and every expert node go; MoE + Softmax + ReduceMax (+ axes) come.
    ops = [n.op_type for n in model.graph]
    assert "TopK" not in ops and "Clip" not in ops and "Sigmoid" not in ops and ops.count("Gemm") == 1
    assert sorted(ops) == sorted(["Gemm", "MoE", "Softmax", "ReduceMax", "Constant"])
    assert (before, len(ops)) == ((38 if exporter == "dynamo" else 33), 5)
    # Idempotent: a second run finds nothing.
    again = SkipExperts()(model)
    assert not again.modified


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_reference_equals_the_export(exporter: str, tokens: int) -> None:
    proto = gpt_oss_block(exporter)
    model, _, _ = _skip(proto)
    node = _moe_node(model)
    arrays = [v.const_value.numpy() for v in node.inputs[2:8]]
    x = _tokens(tokens, tokens)
    w = _weights()
    logits = x @ w["router"].T + w["router_bias"]
    y, mask = moe_reference(
        x, logits, *arrays[:3], top_k=K, normalize=1, activation="swiglu_oai", b_gate=arrays[3], b_up=arrays[4],
        b_down=arrays[5], activation_alpha=ALPHA, activation_limit=LIMIT,
    )  # fmt: skip
    (expected,) = _session(proto).run(["y"], {"x": x})
    np.testing.assert_allclose(y, expected, atol=ATOL, rtol=RTOL)
    assert mask.sum() == K * tokens
    if tokens == 16:  # the clamps are exercised on these tokens (else the test would not see them)
        gate = np.einsum("th,ehf->etf", x, w["gate_up"][..., ::2]) + w["gate_up_bias"][:, None, ::2]
        assert (gate > LIMIT).any() and (np.abs(gate) < LIMIT).any()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_lowerings_equal_the_export(exporter: str, lowering: str, tokens: int) -> None:
    proto = gpt_oss_block(exporter)
    compiled, lower = _lowered(proto, lowering)
    assert [lo for _, lo in lower.lowered] == [lowering]
    ops = [n.op_type for n in compiled.graph.node]
    if lowering == "ort-moe":
        moe = [n for n in compiled.graph.node if n.domain == "com.microsoft" and n.op_type == "MoE"]
        assert len(moe) == 1 and moe[0].input[3] and moe[0].input[5]  # fc1 / fc2 biases
    else:
        assert ops.count("If") == E and "MoE" not in ops
    onnx.checker.check_model(compiled, full_check=True)
    _assert_same(proto, compiled, tokens, seed=tokens)


VARIANTS = {
    "no-clamp": {"clamp": "none"},
    "alpha-1": {"alpha": 1.0},
    "concatenated": {"layout": "concatenated"},
    "no-biases": {"biases": False},
}


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_rewrite_and_lower(variant: str, tokens: int) -> None:
    proto = gpt_oss_block("dynamo", **VARIANTS[variant])
    model, _, _ = _skip(proto)
    node = _moe_node(model)
    attrs = {k: a.value for k, a in node.attributes.items()}
    if variant == "no-clamp":
        assert attrs["activation_limit"] == np.inf
    if variant == "alpha-1":
        assert attrs["activation_alpha"] == 1.0
    assert len(node.inputs) == (5 if variant == "no-biases" else 8)
    for lowering in ("if", "ort-moe"):
        _assert_same(proto, _lowered(proto, lowering)[0], tokens, seed=tokens)


def test_clamps_that_differ_are_refused_with_the_reason() -> None:
    _model, skip, result = _skip(gpt_oss_block("dynamo", clamp="mismatch"))
    assert not result.modified and len(skip.rejected) == 1
    rejection = skip.rejected[0]
    assert "up is not clamped to [-7.0, 7.0]" in rejection.reason, rejection.reason
    assert rejection.path == "model.layers.0.mlp.experts" or rejection.node


# --- semantics: reference, ORT MoE support, native refusal ------------------------------------------------------


def test_glu_swiglu_oai_matches_the_gpt_oss_formula() -> None:
    gate = np.array([-9.0, -1.0, 0.0, 2.0, 7.5, 20.0])
    up = np.array([-9.0, 8.0, 1.0, -2.0, 3.0, 0.5])
    g = np.minimum(gate, 7.0)
    expected = (np.clip(up, -7.0, 7.0) + 1) * g * (1 / (1 + np.exp(-1.702 * g)))
    np.testing.assert_allclose(glu(gate, up, "swiglu_oai", 1.702, 7.0), expected, rtol=1e-12)
    np.testing.assert_allclose(glu(gate, up, "silu"), gate / (1 + np.exp(-gate)) * up, rtol=1e-12)


def test_ort_moe_supports_swiglu_oai_not_gelu() -> None:
    assert ort_moe_supports("softmax", "swiglu_oai", 0.0) is None
    assert "activation 'gelu'" in ort_moe_supports("softmax", "gelu", 0.0)


def test_native_runs_biases_and_swiglu_oai() -> None:
    """The native kernel implements moe_op_v2's experts: the node keeps its biases (5-7), the threshold goes to 9,
    and the kernel computes the reference (when liblayerzero_ort.so can be built here)."""
    from layerzero.passes._dynamic import THRESHOLD_INPUT
    from tests.plugins.native_build import build_ort_test_library as _build

    for biases in (True, False):
        model, _, _ = _skip(gpt_oss_block("dynamo", biases=biases))
        node = _moe_node(model)
        assert native_supports(node) is None
        spec = [v.name if v is not None else None for v in node.inputs[2:8]]
        lower = LowerMoE(lowering="native", native_present=True)
        lower(model)
        assert [lo for _, lo in lower.lowered] == ["native"]
        node = _moe_node(model)
        assert node.inputs[-1].name == THRESHOLD_INPUT
        assert [v.name if v is not None else None for v in node.inputs[2 : 2 + len(spec)]] == spec  # biases kept
        assert len(node.inputs) == 10  # the threshold in its own slot, after the (empty) v2 slots
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(_build(asan=False)))
    for biases in (True, False):
        proto = gpt_oss_block("dynamo", biases=biases)
        compiled, lower = _lowered(proto, "native")
        for tokens in TOKENS:
            x = _tokens(tokens, tokens)
            (expected,) = _session(proto).run(["y"], {"x": x})
            session = ort.InferenceSession(compiled.SerializeToString(), options, providers=["CPUExecutionProvider"])
            (got,) = session.run(["y"], {"x": x})
            np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


# --- issue 14: an overridable expert weight is no constant ------------------------------------------------------


def test_overridable_expert_weight_is_not_folded_into_the_block() -> None:
    proto = gpt_oss_block("dynamo", overridable=True)
    _model, skip, result = _skip(proto)
    assert not result.modified
    assert "gate_up_proj is not a constant weight" in skip.rejected[0].reason


def test_lowering_refuses_an_moe_node_with_an_overridable_weight() -> None:
    model, _, _ = _skip(gpt_oss_block("dynamo", biases=False))
    node = _moe_node(model)
    weight = node.inputs[2]
    model.graph.inputs.append(weight)  # the initializer becomes a graph input: a feed may override it
    assert "also a graph input" in native_supports(node)
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    with pytest.raises(
        UnsupportedModelError, match=r"MoE node .*: expert weight .* initializer that is also a graph input"
    ):
        LowerMoE(lowering="if")(model)


def test_solidify_drops_the_dropped_experts_biases_too() -> None:

    from layerzero.passes.solidify_paths import DropExperts

    model, _, _ = _skip(gpt_oss_block("dynamo"))
    node = _moe_node(model)
    before = [v.const_value.numpy() for v in node.inputs[2:8]]
    path = node.attributes["path"].value
    assert DropExperts([f"{path}.experts.1"])(model).modified
    node = _moe_node(model)
    after = [v.const_value.numpy() for v in node.inputs[2:8]]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old[[0, 2, 3]])


# --- JetMoE (dynamo): rows sorted by expert, Split by the experts' counts, ScatterND add -----------------------


def jetmoe_block(
    *, sizes_from: str = "counts", one_projection: bool = False, select: str = "", seed: int = 1
) -> onnx.ModelProto:
    """JetMoE's ``JetMoeMoE`` (without its layer bias) the way the dynamo exporter writes it; ``one_projection``:
    experts of one projection each (the shape of its attention experts' output projection). ``select``: each
    expert's weight is ``weight[e]`` of the stacked parameter, left unfolded (large weights past an exporter's
    folding limit): ``"gather"`` (``Gather(W, e)``, a scalar index), ``"slice"`` (``Squeeze(Slice(W, e, e+1))``),
    ``"gather-transpose"`` (``MatMul(x, Transpose(Gather(W, e)))``)."""
    rng = np.random.default_rng(seed)
    f32, i64 = np.float32, np.int64
    w_router = rng.normal(0, 1, (E, H)).astype(f32)
    w_in = rng.normal(0, 0.3, (E, 2 * F, H)).astype(f32)  # [E, out, in], gate | up concatenated
    w_out = rng.normal(0, 0.3, (E, H, F)).astype(f32)
    nodes, inits = [], []

    def node(op: str, inputs: list[str], outs: list[str] | str, **attrs) -> str:
        outs = [outs] if isinstance(outs, str) else outs
        nodes.append(helper.make_node(op, inputs, outs, name=f"/model/layers.0/mlp/{outs[0]}", **attrs))
        return outs[0]

    def const(name: str, array) -> str:
        inits.append(_c(name, array))
        return name

    zero, one, minus = (
        const("ax0", np.array([0], i64)),
        const("ax1", np.array([1], i64)),
        const("m1", np.array([-1], i64)),
    )
    logits = node("Gemm", ["x", const("router.layer.weight", w_router)], "logits", transB=1)
    node("TopK", [logits, const("k", np.array([K], i64))], ["vals", "idx"], axis=1)
    probs = node("Softmax", ["vals"], "probs", axis=1)
    zeros_te = node(
        "ConstantOfShape", [node("Shape", [logits], "logits_shape")], "zeros_te", value=_c("z", np.array([0.0], f32))
    )
    ones = node("ConstantOfShape", [node("Shape", ["idx"], "idx_shape")], "ones", value=_c("o", np.array([1.0], f32)))
    hot = node("ScatterElements", [zeros_te, "idx", ones], "hot", axis=1)
    counts = node("ReduceSum", [node("Cast", [hot], "hot_i", to=TensorProto.INT64), zero], "counts", keepdims=0)
    if sizes_from == "counts":
        parts = []
        for e in range(E):
            bounds = [const(f"s{e}", np.array([e], i64)), const(f"e{e}", np.array([e + 1], i64)), zero]
            count = node("Squeeze", [node("Slice", [counts, *bounds], f"count{e}"), zero], f"count{e}_s")
            parts.append(node("Reshape", [count, minus], f"count{e}_r"))
        sizes = node("Concat", parts, "sizes", axis=0)
    else:  # a Split at sizes that are not the counts: no block
        sizes = node("Cast", [node("Reshape", [counts, minus], "counts_flat")], "sizes", to=TensorProto.INT64)
    flat = node("Reshape", ["idx", minus], "flat")
    length = node(
        "Reshape",
        [node("Gather", [node("Shape", [flat], "flat_shape"), const("i0", np.array(0, i64))], "flat_len", axis=0), one],
        "n",
    )
    node("TopK", [flat, length], ["sorted_ids", "order"], axis=0, largest=0)
    d = node(
        "Div", [node("Cast", ["order"], "order_f", to=TensorProto.FLOAT), const("kf", np.array(float(K), f32))], "d"
    )
    token = node(
        "Cast",
        [node("Mul", [node("Floor", [node("Abs", [d], "d_abs")], "d_floor"), node("Sign", [d], "d_sign")], "d_trunc")],
        "token",
        to=TensorProto.INT64,
    )
    rows = node("Unsqueeze", [token, minus], "rows")
    xs = node("GatherND", ["x", rows], "xs")

    def weight_of(weights: np.ndarray, tag: str, e: int) -> str:
        if not select:
            return const(f"{tag}.w{e}", weights[e])
        stacked = f"{tag}.weight"
        if stacked not in [t.name for t in inits]:
            const(stacked, weights)
        if select == "slice":
            bounds = [const(f"{tag}.s{e}", np.array([e], i64)), const(f"{tag}.e{e}", np.array([e + 1], i64)), zero]
            return node("Squeeze", [node("Slice", [stacked, *bounds], f"{tag}_sl{e}"), zero], f"{tag}_sel{e}")
        return node("Gather", [stacked, const(f"{tag}.i{e}", np.array(e, i64))], f"{tag}_sel{e}", axis=0)

    def linear(x: str, weights: np.ndarray, tag: str, e: int) -> str:
        weight = weight_of(weights, tag, e)
        if select == "gather-transpose":
            return node("MatMul", [x, node("Transpose", [weight], f"{tag}_t{e}", perm=[1, 0])], f"{tag}_y{e}")
        return node("Gemm", [x, weight], f"{tag}_y{e}", transB=1)

    def per_expert(x: str, weights: np.ndarray, tag: str) -> str:
        outs = [f"{tag}_part{e}" for e in range(E)]
        node("Split", [x, sizes], outs, axis=0)
        return node("Concat", [linear(outs[e], weights, tag, e) for e in range(E)], f"{tag}_cat", axis=0)

    if one_projection:
        out = per_expert(xs, rng.normal(0, 0.3, (E, H, H)).astype(f32), "out")
    else:
        fused = per_expert(xs, w_in, "in")
        node("Split", [fused], ["gate", "up"], axis=1, num_outputs=2)
        h = node("Mul", [node("Mul", ["gate", node("Sigmoid", ["gate"], "sig")], "silu"), "up"], "h")
        out = per_expert(h, w_out, "out")
    weights = node(
        "GatherND",
        [node("Reshape", [probs, minus], "probs_flat"), node("Unsqueeze", ["order", minus], "order_rows")],
        "w_sorted",
    )
    weighted = node("Mul", [out, node("Unsqueeze", [weights, one], "w_col")], "weighted")
    upd = node(
        "Expand",
        [
            weighted,
            node(
                "Concat",
                [node("Shape", [token], "token_shape"), const("width", np.array([H], i64))],
                "upd_shape",
                axis=0,
            ),
        ],
        "upd",
    )
    acc = node("ConstantOfShape", [node("Shape", ["x"], "x_shape")], "acc", value=_c("z2", np.array([0.0], f32)))
    node("ScatterND", [acc, rows, upd], "y", reduction="add")
    graph = helper.make_graph(
        nodes, "jetmoe_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def test_jetmoe_sorted_block_is_rewritten() -> None:
    proto = jetmoe_block()
    model, skip, result = _skip(proto)
    assert result.modified and skip.rewritten and [f for _, f in skip.rewritten] == ["sorted"], skip.rejected
    node = _moe_node(model)
    attrs = {k: a.value for k, a in node.attributes.items()}
    assert (attrs["activation"], attrs["normalize"], attrs["top_k"]) == ("silu", 1, K) and len(node.inputs) == 5
    # The shape arithmetic left dead (Shape / Gather / Reshape of sizes) goes in the pipeline's dead-code removal.
    RemoveUnusedNodesPass()(model)
    assert sorted(n.op_type for n in model.graph) == sorted(["Gemm", "MoE", "Softmax", "ReduceMax", "Constant"])
    assert not SkipExperts()(model).modified


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
def test_jetmoe_sorted_block_lowerings_equal_the_export(lowering: str, tokens: int) -> None:
    proto = jetmoe_block()
    _assert_same(proto, _lowered(proto, lowering)[0], tokens, seed=tokens)


@pytest.mark.parametrize("select", ["gather", "slice", "gather-transpose"])
def test_jetmoe_experts_selecting_their_weights_are_rewritten(select: str) -> None:
    """Issue 20: experts reading ``weight[e]`` of the stacked parameter (``select``, not folded) were refused
    ("... is not a constant weight")."""
    proto = jetmoe_block(select=select)
    _, skip, result = _skip(proto)
    assert result.modified and [f for _, f in skip.rewritten] == ["sorted"], skip.rejected
    for tokens in TOKENS:
        _assert_same(proto, _lowered(proto, "if")[0], tokens, seed=tokens)


def test_jetmoe_split_at_other_sizes_is_refused() -> None:
    _, skip, result = _skip(jetmoe_block(sizes_from="other"))
    assert not result.modified
    assert any("split sizes" in r.reason for r in skip.rejected), skip.rejected


def test_experts_of_one_projection_are_refused_with_the_reason() -> None:
    _, skip, result = _skip(jetmoe_block(one_projection=True))
    assert not result.modified and len(skip.rejected) == 1
    assert "not a gated unit" in skip.rejected[0].reason and "GatherND" in skip.rejected[0].reason, skip.rejected


# --- biases in the other block shapes: unrolled (one MatMul + bias per expert) and dense ([E, 1, out] bias) -----


def _with_biases(proto: onnx.ModelProto, seed: int = 3) -> onnx.ModelProto:
    from layerzero.models.moe import with_expert_biases

    proto = with_expert_biases(proto, seed)
    onnx.checker.check_model(proto)
    return proto


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("form, fused", [("unrolled", False), ("unrolled", True), ("dense", False), ("dense", True)])
def test_biases_in_every_block_shape(form: str, fused: bool, tokens: int) -> None:
    from layerzero.models.moe import MoEConfig, build_moe

    config = MoEConfig(form=form, fused_gate_up=fused, layers=1, hidden=H, ffn=F)
    proto = _with_biases(build_moe(config))
    x_name = proto.graph.input[0].name
    model, skip, result = _skip(proto)
    assert result.modified, skip.rejected
    node = _moe_node(model)
    assert len(node.inputs) == 8 and all(v is not None for v in node.inputs[5:])
    y_name = proto.graph.output[0].name
    feeds = {x_name: np.random.default_rng(tokens).normal(0, 1, (tokens, H)).astype(np.float32)}
    (expected,) = _session(proto).run([y_name], feeds)
    for lowering in ("if", "ort-moe"):
        compiled, _ = _lowered(proto, lowering)
        (got,) = _session(compiled).run([y_name], feeds)
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


def test_a_node_kept_for_the_native_kernel_lowers_again_unchanged() -> None:
    # lower_moe_native puts the run-time threshold in its own slot (input 9, passes/_moe_node.py), after the empty
    # v2 slots: a second LowerMoE run reads it as the threshold, not as a bias.
    from layerzero.models.moe import MoEConfig, build_moe
    from layerzero.passes._dynamic import THRESHOLD_INPUT

    model = ir.from_proto(build_moe(MoEConfig(form="skipping", hidden=H, ffn=F)))
    for _ in range(2):
        lower = LowerMoE(lowering="native", native_present=True)
        lower(model)
        assert [lo for _, lo in lower.lowered] == ["native"]
    node = _moe_node(model)
    assert len(node.inputs) == 10 and node.inputs[9].name == THRESHOLD_INPUT and node.inputs[5:9] == (None,) * 4
