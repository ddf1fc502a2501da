"""Activation-sparse MoE experts (issue 23): ``find_groups`` makes a float ``ai.layerzero::MoE`` block one group
(its router never a group), ``SparsifyActivations`` writes its reference form (the hidden input thresholded, the
router reading it unthresholded) and ``FuseExpertActivationMask`` takes that mask into the native kernel (gate / up
input-major, thresholds at 13-14, the kept count as output 2). Numerics: the fused model against the reference
form and against a numpy forward of the same thresholds; scale 0 = dense; a quantized block is left alone."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.contract import ACTIVATION_SCALE_INPUT, DYNAMIC_META_KEY, MASK_PREFIX
from layerzero.passes._dynamic import threshold_input
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.sparsify_activations import SparsifyActivations, find_groups
from layerzero.passes.sparsify_experts import FuseExpertActivationMask
from layerzero.plugins.reference import moe_reference

E, K, H, F = 4, 2, 64, 96
GROUP = "model.layers.0.mlp.experts.gate_up"


def _model(seed: int = 0) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """x -> router MatMul -> logits; MoE(x, logits, experts, threshold) -> y; one MatMul after (o, a group)."""
    rng = np.random.default_rng(seed)
    w = {
        "router": (rng.standard_normal((H, E)) / np.sqrt(H)).astype(np.float32),
        "wg": (rng.standard_normal((E, F, H)) / np.sqrt(H)).astype(np.float32),
        "wu": (rng.standard_normal((E, F, H)) / np.sqrt(H)).astype(np.float32),
        "wd": (rng.standard_normal((E, H, F)) / np.sqrt(F)).astype(np.float32),
    }

    def const(name: str, array: np.ndarray) -> ir.Value:
        v = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(array.shape),
                     const_value=ir.tensor(array, name=name))  # fmt: skip
        return v

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["T", H]))
    inits = {n: const(f"model.layers.0.mlp.{n}", a) for n, a in w.items()}
    router = ir.Node("", "MatMul", [x, inits["router"]], name="/model/layers.0/mlp/gate/MatMul")
    graph = ir.Graph([x], [], nodes=[router], initializers=list(inits.values()), name="g",
                     opset_imports={"": 18, "ai.layerzero": 1})  # fmt: skip
    model = ir.Model(graph, ir_version=10)
    thr = threshold_input(model, 0.0)
    moe = ir.Node("ai.layerzero", "MoE", [x, router.outputs[0], inits["wg"], inits["wu"], inits["wd"],
                                          None, None, None, None, thr],
                  attributes=[ir.AttrInt64("top_k", K), ir.AttrInt64("normalize", 1)], num_outputs=2,
                  name="/model/layers.0/mlp/experts/MoE")  # fmt: skip
    graph.append(moe)
    y, mask = moe.outputs
    y.name, mask.name = "y", "experts_mask"
    graph.outputs.extend([y, mask])
    InferShapes()(model)
    y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape(["T", H])
    mask.dtype, mask.shape = ir.DataType.BOOL, ir.Shape(["T", E])
    return model, w


def _session(model: ir.Model):
    """A session with liblayerzero_ort.so (skips, or fails under LAYERZERO_REQUIRE_NATIVE=1, where it cannot be
    built)."""
    import onnxruntime as ort

    from tests.plugins.native_build import build_ort_test_library

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(build_ort_test_library()))
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_groups_take_the_experts_and_leave_the_router():
    model, _ = _model()
    groups = find_groups(model)
    assert [g.name for g in groups] == [GROUP]  # the router's MatMul reads the same x: never a group
    g = groups[0]
    assert g.experts and g.channels == H and g.params == K * 2 * F * H  # the routed gate / up of one token


def _thresholds(seed: int = 1) -> np.ndarray:
    return (np.abs(np.random.default_rng(seed).standard_normal(H)) * 0.8).astype(np.float32)


def _forward(w, x, t, scale):
    xm = np.where(np.abs(x) <= t * np.float32(scale), np.float32(0), x)
    logits = x @ w["router"]  # the router sees x as it is
    y, _ = moe_reference(xm, logits, w["wg"], w["wu"], w["wd"], top_k=K, normalize=1)
    return y, (~(np.abs(x) <= t * np.float32(scale))).sum(-1)


def test_reference_form_then_fused_match_numpy():
    t = _thresholds()
    model, w = _model()
    assert SparsifyActivations({GROUP: t}, native=True)(model).modified  # experts: the reference form even so
    reference = ir.from_proto(ir.to_proto(model))
    assert any(n.op_type == "Where" for n in model.graph)
    step = FuseExpertActivationMask()
    assert step(model).modified and step.fused == [MASK_PREFIX + GROUP]
    (moe,) = [n for n in model.graph if n.op_type == "MoE"]
    assert len(moe.inputs) == 15 and moe.attributes["gate_up_layout"].value == "input_major"
    assert moe.inputs[2].shape == ir.Shape([E, H, F]) and moe.inputs[4].shape == ir.Shape([E, H, F])
    assert not any(n.op_type in ("Where", "LessOrEqual", "ReduceSum") for n in model.graph)
    paths = {p["path"]: p for p in json.loads(model.metadata_props[DYNAMIC_META_KEY])}
    assert paths[GROUP]["detail"]["form"] == "native"
    assert not FuseExpertActivationMask()(model).modified  # idempotent
    fused, ref = _session(model), _session(reference)
    rng = np.random.default_rng(4)
    for tokens in (1, 7):
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        for scale in (1.0, 0.4, 0.0):
            feeds = {"x": x, ACTIVATION_SCALE_INPUT: np.array(scale, np.float32)}
            got = dict(zip([o.name for o in fused.get_outputs()], fused.run(None, feeds)))
            want = dict(zip([o.name for o in ref.get_outputs()], ref.run(None, feeds)))
            y, kept = _forward(w, x, t, scale)
            np.testing.assert_allclose(got["y"], y, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(got["y"], want["y"], rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(got[MASK_PREFIX + GROUP], kept)
            np.testing.assert_array_equal(want[MASK_PREFIX + GROUP], kept)
            np.testing.assert_array_equal(got["experts_mask"], want["experts_mask"])
            if scale == 0.0:
                assert (kept == H).all()


def test_quantized_experts_and_foreign_masks_are_left_alone():
    model, _ = _model()
    SparsifyActivations({GROUP: _thresholds()}, native=False)(model)
    (moe,) = [n for n in model.graph if n.op_type == "MoE"]
    moe.attributes["weight_format"] = ir.AttrString("weight_format", "q8")  # as QuantizeWeights marks them
    assert not FuseExpertActivationMask()(model).modified
    model, _ = _model()
    assert not FuseExpertActivationMask()(model).modified  # no mask at all


@pytest.mark.parametrize("what", ["router", "unnamed-scope"])
def test_no_group_without_a_layer_scope_or_for_the_router(what):
    model, _ = _model()
    (moe,) = [n for n in model.graph if n.op_type == "MoE"]
    if what == "unnamed-scope":
        moe.name = "MoE"
        assert find_groups(model) == []
    else:
        router = next(n for n in model.graph if n.op_type == "MatMul")
        assert router not in [p for g in find_groups(model) for p in g.projections]


@pytest.mark.parametrize("target, dense", [(0.2, True), (0.6, False)])
def test_experts_below_the_break_even_level_stay_dense(target, dense):
    """``pipeline._sparsify``: an expert group the allocation puts below ``EXPERT_MIN_LEVEL`` is not sparsified
    (the input-major kernel would read its kept rows slower than the dense one reads them all)."""
    from layerzero.activation_calibration import group_samples
    from layerzero.options import CompileOptions
    from layerzero.pipeline import EXPERT_MIN_LEVEL, _sparsify

    model, _ = _model()
    groups = find_groups(model)
    x = np.random.default_rng(2).standard_normal((256, H)).astype(np.float32)
    samples = group_samples(groups, {GROUP: x})
    options = CompileOptions(activation_sparsity=target, max_deviation=1.0)
    record = _sparsify(model, options, samples, 256, "onnxruntime", None, [], {GROUP})
    assert (record["experts_kept_dense"] == [GROUP]) is dense
    assert (record["groups"][GROUP] == 0.0) is dense and (target < EXPERT_MIN_LEVEL) is dense
    assert any(n.op_type == "Where" for n in model.graph) is not dense
    if dense:
        assert record["realized_on_calibration"] == 0.0


def test_activation_sparsity_on_quantized_experts_alone_says_why_nothing_is_sparsified():
    """A MoE model whose only projection groups are its experts, with ``--weights``: quantized experts keep the dense
    kernel, so the compile refuses in one line naming that (not "no float MatMul", which the model has)."""
    from layerzero.compile import compile_model
    from layerzero.errors import InvalidInputError
    from layerzero.models.moe import MoEConfig, build_moe
    from layerzero.options import CompileOptions

    proto = build_moe(MoEConfig(hidden=64, ffn=64, experts=4, top_k=2))
    options = CompileOptions(weights="int4", activation_sparsity=0.3, max_deviation=1e9, moe_lowering="if")
    first = r"\(1, the first 'layers\.0\.moe\.experts\.gate_up'\)"
    why = rf"--weights int4: the model's only projection groups are MoE experts {first}, and quantized experts keep"
    with pytest.raises(InvalidInputError, match=why) as info:
        compile_model(proto, options)
    assert "\n" not in str(info.value)
    # float experts are sparsified
    result = compile_model(proto, CompileOptions(activation_sparsity=0.5, max_deviation=1e9, moe_lowering="if"))
    assert result.activation_sparsity["groups"]["layers.0.moe.experts.gate_up"] > 0


@pytest.mark.parametrize("lowering", ["auto", "if"])
def test_activation_sparsity_on_a_qmoe_model_refuses_and_never_thresholds_its_router(lowering: str) -> None:
    """A model whose experts come quantized (``com.microsoft::QMoE`` as ONNX Runtime GenAI writes it, its router a
    MatMul in the graph): with the native lowering the QMoE becomes quantized experts, with ``if`` it is left as
    ONNX Runtime's op. Either way no float group is left: the refusal names the quantized experts (it said "no
    float MatMul"; with ``if`` the compile sparsified the router's MatMul alone, which changes the routing)."""
    from layerzero.compile import compile_model
    from layerzero.errors import InvalidInputError
    from layerzero.models.moe import build_qmoe
    from layerzero.options import CompileOptions
    from layerzero.plugins.ort_library import find_ort_library

    if lowering == "auto" and find_ort_library() is None:
        pytest.skip("liblayerzero_ort.so is not built: the QMoE is not rewritten to quantized experts")
    proto = build_qmoe(experts=4, hidden=64, ffn=64, top_k=2, bits=4, block=32, accuracy=4, router=True)
    options = CompileOptions(activation_sparsity=0.3, max_deviation=1e9, moe_lowering=lowering)
    op = "MoE" if lowering == "auto" else "QMoE"
    why = rf"its 1 MoE block\(s\) hold quantized experts \(the first 'layers\.0\.moe[a-z.]*', {op}\), which keep"
    with pytest.raises(InvalidInputError, match=why) as info:
        compile_model(proto, options)
    assert "\n" not in str(info.value) and "nothing to sparsify" in str(info.value)
    # a QMoE whose experts become float (4 bits at accuracy level 0): the experts are the one group, not the router
    proto = build_qmoe(experts=4, hidden=64, ffn=64, top_k=2, bits=4, block=32, accuracy=0, router=True)
    result = compile_model(proto, CompileOptions(activation_sparsity=0.5, max_deviation=1e9, moe_lowering=lowering))
    assert result.activation_sparsity["groups"] == {"layers.0.moe.experts.gate_up": 0.5}


def _sparsemixer_layer():
    """x -> o_proj MatMul (a dense group) -> h; logits = h @ router; y = MoE(h, logits, ...) with PhiMoE's
    sparsemixer routing, which liblayerzero_ort.so's kernel does not run (the target lowers it to If)."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(5)
    arrays = {
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((H, H)).astype(np.float32) / np.sqrt(H),
        "model.layers.0.mlp.gate.weight": rng.standard_normal((H, E)).astype(np.float32) / np.sqrt(H),
        "w_gate": rng.standard_normal((E, F, H)).astype(np.float32) / np.sqrt(H),
        "w_up": rng.standard_normal((E, F, H)).astype(np.float32) / np.sqrt(H),
        "w_down": rng.standard_normal((E, H, F)).astype(np.float32) / np.sqrt(F),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "model.layers.0.self_attn.o_proj.weight"], ["h"],
                         name="/model/layers.0/self_attn/o_proj/MatMul"),
        helper.make_node("MatMul", ["h", "model.layers.0.mlp.gate.weight"], ["logits"],
                         name="/model/layers.0/mlp/gate/MatMul"),
        helper.make_node("MoE", ["h", "logits", "w_gate", "w_up", "w_down"], ["y", "mask"], domain="ai.layerzero",
                         name="/model/layers.0/mlp/experts/MoE", top_k=2, normalize=0, scoring="softmax",
                         activation="silu", routing="sparsemixer", jitter_eps=0.01, zeroing_threshold=0.0,
                         path="model.layers.0.mlp.experts"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", H])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", H])],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def test_calibration_runs_a_model_holding_a_block_the_kernel_does_not_run():
    """The calibration runs before the target's lowering: a MoE block liblayerzero_ort.so does not run (PhiMoE's
    sparsemixer) made its sessions fail ("the model needs liblayerzero_ort.so", with the library built). The
    calibration copies now lower such blocks as the target would; the model itself is left as it was."""
    from layerzero.activation_calibration import collect_activations
    from layerzero.activation_runs import output_deviation

    _session(_model()[0])  # builds liblayerzero_ort.so (or skips where it cannot be built)
    model = ir.from_proto(_sparsemixer_layer())
    InferShapes()(model)
    before = ir.to_proto(model).SerializeToString()
    groups = [g for g in find_groups(model) if not g.experts]
    assert [g.name for g in groups] == ["model.layers.0.self_attn.o"]
    x = np.random.default_rng(1).standard_normal((6, H)).astype(np.float32)
    got = collect_activations(model, groups, [{"x": x}])
    np.testing.assert_array_equal(got["model.layers.0.self_attn.o"], x)
    evaluate = output_deviation(model, [{"x": x}])
    assert evaluate({}) == 0.0 and evaluate({groups[0].name: np.full(H, 0.5, np.float32)}) > 0
    assert ir.to_proto(model).SerializeToString() == before
