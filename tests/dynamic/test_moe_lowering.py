"""The skipping form ``ai.layerzero::MoE``: numpy reference vs the ``if`` and ``ort-moe`` lowerings.

Models are the ``skipping`` form of ``layerzero.models.moe`` (one MoE node, outputs ``y`` and ``mask``),
lowered with ``LowerMoE`` alone and run with ONNX Runtime on random tokens.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.errors import InvalidInputError
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_layer_weights
from layerzero.passes._dynamic import THRESHOLD_INPUT
from layerzero.passes.lower_moe import LowerMoE
from layerzero.passes.shape_inference import InferShapes
from layerzero.plugins.reference import moe_reference, moe_routing

ATOL = 1e-5
TOKENS = (1, 7, 32)

CASES = {
    "softmax-norm-silu": MoEConfig(form="skipping"),
    "softmax-silu-qwen": MoEConfig(form="skipping", normalize=False),
    "top1-of-6": MoEConfig(form="skipping", experts=6, top_k=1, ffn=32),
    "top3-of-6": MoEConfig(form="skipping", experts=6, top_k=3, ffn=48, hidden=32),
    "sigmoid-relu": MoEConfig(form="skipping", scoring="sigmoid", activation="relu", normalize=False),
    "sigmoid-norm-gelu": MoEConfig(form="skipping", scoring="sigmoid", activation="gelu"),
    "gelu-op-opset20": MoEConfig(form="skipping", activation="gelu", opset=20),
}
ORT_MOE_CASES = [k for k, c in CASES.items() if c.scoring == "softmax" and c.activation == "silu"]


def _session(model: ir.Model | onnx.ModelProto) -> ort.InferenceSession:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


@functools.cache
def _lowered(config: MoEConfig, lowering: str) -> tuple[onnx.ModelProto, ir.passes.PassResult, LowerMoE]:
    model = ir.from_proto(build_moe(config))
    InferShapes()(model)
    lower = LowerMoE(lowering)
    result = lower(model)
    return ir.to_proto(model), result, lower


@functools.cache
def _lowered_session(config: MoEConfig, lowering: str) -> ort.InferenceSession:
    return _session(_lowered(config, lowering)[0])


def _reference(config: MoEConfig, hidden: np.ndarray, threshold: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    w = moe_layer_weights(config, 0)
    logits = hidden @ w["router"].T + w["router_bias"]
    return moe_reference(
        hidden,
        logits,
        w["w_gate"],
        w["w_up"],
        w["w_down"],
        top_k=config.top_k,
        normalize=config.normalize,
        scoring=config.scoring,
        activation=config.activation,
        zeroing_threshold=config.zeroing_threshold if threshold is None else threshold,
    )


def _check(session: ort.InferenceSession, config: MoEConfig, tokens: int, seed: int = 0, **extra) -> None:
    hidden = moe_feeds(config, tokens, seed=seed)["hidden"]
    y, mask = session.run(["y", "mask"], {"hidden": hidden, **extra})
    threshold = float(extra[THRESHOLD_INPUT]) if THRESHOLD_INPUT in extra else None
    ref_y, ref_mask = _reference(config, hidden, threshold)
    assert mask.dtype == np.bool_ and mask.shape == (tokens, config.experts)
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_allclose(y, ref_y, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", list(CASES))
def test_if_lowering_equals_reference(case: str, tokens: int) -> None:
    config = CASES[case]
    _check(_lowered_session(config, "if"), config, tokens, seed=tokens)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", ORT_MOE_CASES)
def test_ort_moe_lowering_equals_reference(case: str, tokens: int) -> None:
    config = CASES[case]
    proto = _lowered(config, "ort-moe")[0]
    assert [n.op_type for n in proto.graph.node if n.domain == "com.microsoft"] == ["MoE"]
    _check(_lowered_session(config, "ort-moe"), config, tokens, seed=tokens)


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.9])
def test_if_lowering_with_threshold_equals_reference(threshold: float) -> None:
    config = MoEConfig(form="skipping", experts=6, top_k=3, zeroing_threshold=threshold)
    hidden = moe_feeds(config, 32, seed=3)["hidden"]
    _, ref_mask = _reference(config, hidden)
    _, full_mask = _reference(config, hidden, threshold=0.0)
    assert ref_mask.sum() < full_mask.sum(), "the threshold should drop some routed experts on these tokens"
    _check(_lowered_session(config, "if"), config, 32, seed=3)


def test_threshold_is_a_run_time_input() -> None:
    config = CASES["softmax-norm-silu"]
    session = _lowered_session(config, "if")
    assert THRESHOLD_INPUT in {i.name for i in session.get_overridable_initializers()}
    for threshold in (0.0, 0.4, 0.8):
        _check(session, config, 32, seed=5, **{THRESHOLD_INPUT: np.array(threshold, np.float32)})


def test_ties_go_to_the_lower_expert() -> None:
    # A zero router: every expert scores alike, so the top-k are the k lowest indices (as ORT TopK).
    config = MoEConfig(form="skipping", router_std=0.0)
    hidden = moe_feeds(config, 5)["hidden"]
    _, mask = _reference(config, hidden)
    assert mask[:, :2].all() and not mask[:, 2:].any()
    _check(_lowered_session(config, "if"), config, 5)


def test_ort_moe_breaks_exact_ties_the_other_way() -> None:
    # Known difference (documented in passes/lower_moe.py): com.microsoft.MoE picks the HIGHER indices on
    # exact ties. Equal probabilities need equal logits, which real routers do not produce.
    config = MoEConfig(form="skipping", router_std=0.0)
    hidden = moe_feeds(config, 5)["hidden"]
    y = _lowered_session(config, "ort-moe").run(["y"], {"hidden": hidden})[0]
    w = moe_layer_weights(config, 0)
    logits = np.full((5, config.experts), -50.0, np.float32)
    logits[:, -config.top_k :] = 0.0
    high, _ = moe_reference(hidden, logits, w["w_gate"], w["w_up"], w["w_down"], top_k=2, normalize=True)
    np.testing.assert_allclose(y, high, atol=ATOL)


def test_routing_reference_by_hand() -> None:
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]))
    weights, mask = moe_routing(logits, top_k=2, normalize=True)
    np.testing.assert_allclose(weights, [[0, 2 / 3, 1 / 3], [2 / 3, 1 / 3, 0]])
    np.testing.assert_array_equal(mask, [[False, True, True], [True, True, False]])
    weights, mask = moe_routing(logits, top_k=2, normalize=True, zeroing_threshold=0.6)
    np.testing.assert_allclose(weights, [[0, 2 / 3, 0], [2 / 3, 0, 0]])  # dropped, not renormalised
    np.testing.assert_array_equal(mask, [[False, True, False], [True, False, False]])


@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
def test_lowering_pass_contract(lowering: str) -> None:
    config = CASES["softmax-norm-silu"]
    proto, result, lower = _lowered(config, lowering)
    assert result.modified is True
    assert lower.lowered == [("layers.0.moe", lowering)]
    onnx.checker.check_model(proto, full_check=True)
    assert not [n for n in proto.graph.node if n.domain == "ai.layerzero"]
    assert "ai.layerzero" not in {o.domain for o in proto.opset_import}
    again = ir.from_proto(proto)
    assert LowerMoE(lowering)(again).modified is False
    if lowering == "if":
        ifs = [n for n in proto.graph.node if n.op_type == "If"]
        assert len(ifs) == config.experts
        then_ops = {n.op_type for n in ifs[0].attribute[0].g.node}
        assert {"NonZero", "Gather", "MatMul", "ScatterND"} <= then_ops


def test_empty_request() -> None:
    config = CASES["softmax-norm-silu"]
    y, mask = _lowered_session(config, "if").run(["y", "mask"], {"hidden": np.zeros((0, config.hidden), np.float32)})
    assert y.shape == (0, config.hidden) and mask.shape == (0, config.experts)


def test_ort_moe_falls_back_to_if_when_it_cannot(caplog) -> None:
    config = CASES["sigmoid-relu"]
    with caplog.at_level(logging.WARNING, logger="layerzero.passes.lower_moe"):
        proto, _, lower = _lowered(config, "ort-moe")
    assert lower.lowered == [("layers.0.moe", "if")]
    assert not [n for n in proto.graph.node if n.domain == "com.microsoft"]
    assert "com.microsoft.MoE cannot run this block (scoring 'sigmoid'" in caplog.text


def test_other_targets_keep_the_skipping_form() -> None:
    model = ir.from_proto(build_moe(CASES["softmax-norm-silu"]))
    assert LowerMoE(enabled=False)(model).modified is False
    assert [n.op_type for n in model.graph if n.domain == "ai.layerzero"] == ["MoE"]


def test_lower_moe_takes_explicit_arguments() -> None:
    config = CASES["softmax-norm-silu"]
    explicit = ir.from_proto(build_moe(config))
    lower = LowerMoE(lowering="ort-moe")
    assert lower(explicit).modified and lower.lowered == [("layers.0.moe", "ort-moe")]
    kept = ir.from_proto(build_moe(config))
    assert not LowerMoE(lowering="if", enabled=False)(kept).modified
    assert any(n.op_type == "MoE" for n in kept.graph)
    with pytest.raises(InvalidInputError, match="moe_lowering='iff'"):
        LowerMoE(lowering="iff")
