"""SkipExperts on the example MoE builders: every form is rewritten and compiles to the original's outputs;
blocks that differ in any checked detail are left alone with a reason."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from layerzero.cli import main
from layerzero.compile import compile_model
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_parameter_count
from layerzero.options import CompileOptions
from layerzero.passes import RemoveDeadCode
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.passes._match import Refusal
from layerzero.passes.moe import SkipExperts
from layerzero.passes.shape_inference import InferShapes

ATOL = 1e-5

FORMS = {
    "batched_mm": MoEConfig(form="batched_mm"),
    "batched_mm-qwen": MoEConfig(form="batched_mm", normalize=False),
    "batched_mm-gelu-opset20": MoEConfig(form="batched_mm", activation="gelu", opset=20),
    "dense-scatter-einsum": MoEConfig(form="dense"),
    "dense-onehot-sum": MoEConfig(form="dense", routing="onehot", combine="sum"),
    # Qwen3-MoE's dense experts through TorchScript: zeros of Concat(Shape(x)[0], [E]) scattered into (issue 20).
    "dense-scatter-rows": MoEConfig(form="dense", routing="scatter-rows"),
    "unrolled-scatter-rows-1-token": MoEConfig(form="unrolled", routing="scatter-rows", top_k=1),
    "dense-fused-relu-sigmoid": MoEConfig(
        form="dense", fused_gate_up=True, activation="relu", scoring="sigmoid", normalize=False
    ),
    "dense-gelu-erf": MoEConfig(form="dense", activation="gelu"),
    "unrolled-scatter": MoEConfig(form="unrolled"),
    "unrolled-onehot-fused": MoEConfig(form="unrolled", routing="onehot", fused_gate_up=True),
    "unrolled-2-layers-residual": MoEConfig(form="unrolled", layers=2, residual=True, experts=3, top_k=1),
}


def _session(model: ir.Model | onnx.ModelProto) -> ort.InferenceSession:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _infer(model: ir.Model) -> None:
    InferShapes()(model)


def _ops(model: ir.Model) -> Counter[str]:
    return Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("form", list(FORMS))
def test_compiled_equals_original(form: str) -> None:
    config = FORMS[form]
    proto = build_moe(config)
    # The `if` lowering pinned: `auto` would keep ai.layerzero::MoE where liblayerzero_ort.so is built.
    options = CompileOptions(atol=ATOL, rtol=1e-5, shapes={"hidden": (16, config.hidden)}, moe_lowering="if")
    result = compile_model(proto, options)
    assert result.verification.passed
    model = result.model
    ops = _ops(model)
    assert ops["If"] == config.experts * config.layers
    # The experts' own compute is gone from the main graph: no GatherND, Einsum, or per-expert MatMul left.
    assert not ops["GatherND"] and not ops["Einsum"] and not ops["MatMul"]
    entries = read_dynamic_paths(model)
    assert [e.path for e in entries] == [config.path(i) for i in range(config.layers)]
    per_expert = 3 * config.hidden * config.ffn
    assert all(e.params == (per_expert,) * config.experts for e in entries)
    assert entries[0].subpaths[-1] == f"layers.0.moe.experts.{config.experts - 1}"
    original, compiled = _session(proto), _session(model)
    for tokens in (1, 32):
        feeds = moe_feeds(config, tokens, seed=tokens)
        expected = original.run(["y"], feeds)[0]
        got = compiled.run(None, feeds)
        np.testing.assert_allclose(got[0], expected, atol=ATOL, rtol=1e-5)
        names = [o.name for o in compiled.get_outputs()]
        assert names[0] == "y" and f"layerzero::mask::{config.path(0)}" in names
        assert f"layerzero::router::{config.path(0)}" in names
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    # Parameters are kept (each expert's weights, once), plus the run-time threshold scalar.
    assert result.after.params <= moe_parameter_count(config) + 1


@pytest.mark.parametrize("form", ["batched_mm", "dense-onehot-sum", "unrolled-scatter"])
def test_pass_contract(form: str) -> None:
    config = FORMS[form]
    model = ir.from_proto(build_moe(config))
    _infer(model)
    skip = SkipExperts()
    assert skip(model).modified is True
    assert skip.rewritten == [("layers.0.moe", form.split("-")[0])] and skip.rejected == []
    RemoveDeadCode()(model)
    # What is left: the router's Gemm, the MoE node, the confidence (scores, axes, ReduceMax), the output Identity.
    assert _ops(model) == Counter({"Gemm": 1, "MoE": 1, "Softmax": 1, "Constant": 1, "ReduceMax": 1, "Identity": 1})
    assert [o.name for o in model.graph.outputs] == [
        "y",
        "layerzero::mask::layers.0.moe",
        "layerzero::router::layers.0.moe",
    ]
    moe = next(n for n in model.graph if n.op_type == "MoE")
    assert moe.domain == "ai.layerzero" and model.opset_imports["ai.layerzero"] == 1
    attrs = {k: a.value for k, a in moe.attributes.items()}
    assert attrs == {
        "top_k": 2,
        "normalize": 1,
        "scoring": "softmax",
        "activation": "silu",
        "zeroing_threshold": 0.0,
        "path": "layers.0.moe",
    }
    assert [tuple(v.shape) for v in moe.inputs[2:]] == [(4, 128, 64), (4, 128, 64), (4, 64, 128)]
    _infer(model)
    again = SkipExperts()
    assert again(model).modified is False and again.rejected == []


# ----------------------------------------------------------------------------------------------- negatives


def _expect_rejected(proto: onnx.ModelProto, reason: str) -> None:
    model = ir.from_proto(proto)
    _infer(model)
    before = _ops(model)
    skip = SkipExperts()
    assert skip(model).modified is False
    assert _ops(model) == before
    assert [r.path for r in skip.rejected] == ["layers.0.moe"], skip.rejected
    assert reason in skip.rejected[0].reason, skip.rejected[0].reason


def _node(proto: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in proto.graph.node if n.name == name)


def _set_const(proto: onnx.ModelProto, node_name: str, input_index: int, value: np.ndarray) -> None:
    source = _node(proto, node_name).input[input_index]
    const = next(n for n in proto.graph.node if n.output[0] == source)
    const.attribute[0].t.CopyFrom(numpy_helper.from_array(value))


def test_wrong_top_k_reshape_is_not_rewritten() -> None:
    proto = build_moe(FORMS["batched_mm"])
    _set_const(proto, "/layers.0.moe.experts/Reshape_3", 1, np.array([-1, 1, 128], np.int64))
    _expect_rejected(proto, "batched_mm: not reshaped to [-1, k=2, H]")


def test_intermediate_read_outside_is_not_rewritten() -> None:
    proto = build_moe(FORMS["dense-scatter-einsum"])
    up = _node(proto, "/layers.0.moe.experts.up_proj/MatMul").output[0]
    proto.graph.output.append(helper.make_tensor_value_info(up, onnx.TensorProto.FLOAT, None))
    _expect_rejected(proto, "is a graph output")


def test_expert_weights_that_are_inputs_are_not_rewritten() -> None:
    proto = build_moe(FORMS["unrolled-scatter"])
    weight = next(t for t in proto.graph.initializer if t.name == "layers.0.moe.experts.2.down_proj.weight")
    proto.graph.input.append(helper.make_tensor_value_info(weight.name, onnx.TensorProto.FLOAT, list(weight.dims)))
    _expect_rejected(proto, "is not a constant weight")


def test_routing_not_from_the_router_is_not_rewritten() -> None:
    # Renormalised by the sum of other values than the top-k ones.
    proto = build_moe(FORMS["batched_mm"])
    div = _node(proto, "/layers.0.moe.gate/Div")
    div.input[1] = _node(proto, "/layers.0.moe.gate/TopK").output[0]
    _expect_rejected(proto, "batched_mm: routing weights: the divisor: expected ReduceSum, found TopK")


def _sigmoid_router(fill: float) -> ir.Model:
    """Llama 4's router (top-k of the logits, sigmoid of the k values scattered into ``fill``), nothing else."""
    scope = "/layers.0.moe.gate"
    zeros = numpy_helper.from_array(np.array([fill], np.float32))
    graph = helper.make_graph(
        [
            helper.make_node("TopK", ["logits", "k"], ["v", "i"], axis=-1, name=f"{scope}/TopK"),
            helper.make_node("Shape", ["logits"], ["shape"], name=f"{scope}/Shape"),
            helper.make_node("ConstantOfShape", ["shape"], ["full"], value=zeros, name=f"{scope}/ConstantOfShape"),
            helper.make_node("ScatterElements", ["full", "i", "v"], ["m"], axis=1, name=f"{scope}/ScatterElements"),
            helper.make_node("Sigmoid", ["m"], ["s"], name=f"{scope}/Sigmoid"),
        ],
        "g",
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["T", 4])],
        [helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["T", 4])],
        initializer=[numpy_helper.from_array(np.array([1], np.int64), "k")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    _infer(model)
    return model


def test_the_router_variant_that_got_furthest_is_the_reason() -> None:
    """Issue 21: the router variants are attempts; the one that matched most nodes says why (here Llama 4's,
    which found the scatter but not the -inf), a ``_match.Refusal`` of kind "moe" at the router's TopK."""
    skip = SkipExperts()
    assert skip(_sigmoid_router(0.0)).modified is False
    (refusal,) = skip.rejected
    assert isinstance(refusal, Refusal) and refusal.kind == "moe"
    assert (refusal.path, refusal.node) == ("layers.0.moe.gate", "TopK /layers.0.moe.gate/TopK")
    assert refusal.reason == (
        "router: ScatterElements /layers.0.moe.gate/ScatterElements does not scatter into -inf (the sigmoid's 0)"
    )
    assert refusal.to_json()["kind"] == "moe"
    # Where no variant gets past the TopK, each one's reason (as before).
    skip = SkipExperts()
    assert skip(_sigmoid_router(-np.inf)).modified is False
    (refusal,) = skip.rejected
    assert "no combination of expert outputs downstream of the router" in refusal.reason


def test_a_router_without_experts_is_a_rejected_candidate() -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["logits"], ["p"], axis=-1, name="/layers.0.moe.gate/Softmax"),
            helper.make_node("TopK", ["p", "k"], ["v", "i"], name="/layers.0.moe.gate/TopK"),
        ],
        "g",
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["T", 4])],
        [
            helper.make_tensor_value_info("v", onnx.TensorProto.FLOAT, ["T", 2]),
            helper.make_tensor_value_info("i", onnx.TensorProto.INT64, ["T", 2]),
        ],
        initializer=[numpy_helper.from_array(np.array([2], np.int64), "k")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    _infer(model)
    skip = SkipExperts()
    assert skip(model).modified is False
    assert [r.path for r in skip.rejected] == ["layers.0.moe.gate"]
    assert "no combination of expert outputs downstream of the router" in skip.rejected[0].reason


def test_old_opset_is_not_rewritten() -> None:
    proto = build_moe(FORMS["dense-scatter-einsum"])
    proto.opset_import[0].version = 15  # ScatterND(reduction="add") of the lowering needs 16
    model = ir.from_proto(proto)
    _infer(model)
    skip = SkipExperts()
    assert skip(model).modified is False
    assert "opset 15 < 16" in skip.rejected[0].reason


def test_inspect_says_why(tmp_path: Path, capsys) -> None:
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    onnx.save(build_moe(FORMS["dense-onehot-sum"]), good)
    proto = build_moe(FORMS["batched_mm"])
    _set_const(proto, "/layers.0.moe.experts/Reshape_3", 1, np.array([-1, 1, 128], np.int64))
    onnx.save(proto, bad)
    assert main(["inspect", str(good)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "MoE block at layers.0.moe: dense, 4 experts, top-2, softmax, renormalised, silu" in out
    assert main(["inspect", str(bad)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "MoE candidate at layers.0.moe: not rewritten (at node Reshape /layers.0.moe.experts/Reshape_3): "
        "batched_mm: not reshaped to [-1, k=2, H]"
    ) in out
    assert main(["inspect", str(bad), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["moe"] == [
        {
            "scope": "layers.0.moe",
            "rewritten": False,
            "detail": "batched_mm: not reshaped to [-1, k=2, H]",
            "node": "Reshape /layers.0.moe.experts/Reshape_3",
        }
    ]


def test_builders_agree_with_each_other() -> None:
    # All forms of one config compute the same function (same weights): the matcher's targets are honest.
    base = MoEConfig()
    feeds = moe_feeds(base, 9, seed=1)
    outs = [
        _session(build_moe(dataclasses.replace(base, form=form))).run(["y"], feeds)[0]
        for form in ("batched_mm", "dense", "unrolled")
    ]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], atol=ATOL)


def test_a_router_no_variant_matches_is_reported_not_skipped() -> None:
    # Sigmoid scores + a correction bias before TopK (DeepSeek-V3 / GLM4-MoE): no router variant yet, so the
    # candidate is refused with the check that failed and the TopK named, instead of passed over silently.
    model = ir.from_proto(
        onnx.parser.parse_model(
            """<ir_version: 10, opset_import: ["" : 18]>
            g (float[T, 8] x) => (float[T, 2] v, int64[T, 2] i) <float[8, 4] w = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0}, float[4] b = {0.0, 0.1, 0.2, 0.3}, int64[1] k = {2}> {
                l = MatMul(x, w)
                s = Sigmoid(l)
                c = Add(s, b)
                v, i = TopK <axis = -1> (c, k)
            }"""
        )
    )
    _infer(model)
    skip = SkipExperts()
    assert skip(model).modified is False
    [rejection] = skip.rejected
    assert rejection.node.startswith("TopK")
    assert "TopK does not read Softmax or Sigmoid scores" in rejection.reason
