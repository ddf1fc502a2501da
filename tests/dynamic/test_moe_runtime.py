"""Compiled MoE bundles at run time: skipped experts do not run, the zeroing threshold, the per-request report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.cli import main
from layerzero.compile import compile_file, compile_model
from layerzero.errors import VerificationError
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_layer_weights, moe_parameter_count
from layerzero.options import CompileOptions
from layerzero.plugins.reference import moe_reference, moe_routing
from layerzero.runtime import Engine

# Expert 3 has a router bias of -100: no token ever picks it.
NEVER_3 = MoEConfig(form="dense", never_routed=(3,))
PATH = "layers.0.moe"
PER_EXPERT = 3 * NEVER_3.hidden * NEVER_3.ffn


def _reference(config: MoEConfig, hidden: np.ndarray, threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    w = moe_layer_weights(config, 0)
    logits = hidden @ w["router"].T + w["router_bias"]
    return moe_reference(
        hidden, logits, w["w_gate"], w["w_up"], w["w_down"], top_k=config.top_k, normalize=config.normalize,
        zeroing_threshold=threshold,
    )  # fmt: skip


def _confidence(config: MoEConfig, hidden: np.ndarray) -> float:
    w = moe_layer_weights(config, 0)
    logits = (hidden @ w["router"].T + w["router_bias"]).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return float((probs / probs.sum(-1, keepdims=True)).max(-1).mean())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    onnx.save(build_moe(NEVER_3), root / "model.onnx")
    compile_file(root / "model.onnx", root / "model.lz", CompileOptions(moe_lowering="if"))
    return root / "model.lz"


def test_skipped_expert_does_not_run(bundle: Path, tmp_path: Path) -> None:
    engine = Engine.load(bundle, enable_profiling=True, profile_file_prefix=str(tmp_path / "profile"))
    hidden = moe_feeds(NEVER_3, 32, seed=2)["hidden"]
    result = engine.run({"hidden": hidden}, masks=True)
    mask = result.report.masks[PATH]
    assert not mask[:, 3].any() and mask[:, :3].any(axis=0).all()
    events = json.loads(Path(engine.backend.end_profiling()).read_text())
    ran = {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"}
    then_branches = {}
    for node in onnx.load(str(engine.model_path)).graph.node:
        if node.op_type == "If":
            then = next(a.g for a in node.attribute if a.name == "then_branch")
            then_branches[node.name] = {n.name for n in then.node if n.op_type != "Constant"}
    assert len(then_branches) == 4
    # Every expert's If ran (the cheap test "is any token routed here"); only experts 0-2 computed anything.
    for e in range(4):
        assert f"/{PATH}.experts.{e}/If" in ran
    for e in range(3):
        then = then_branches[f"/{PATH}.experts.{e}/If"]
        assert {n for n in then if "MatMul" in n} <= ran, e
    assert not then_branches[f"/{PATH}.experts.3/If"] & ran


def test_report_fields(bundle: Path) -> None:
    engine = Engine.load(bundle)
    manifest = engine.manifest
    assert [d["path"] for d in manifest["dynamic"]] == [PATH]
    assert manifest["dynamic"][0]["params"] == [PER_EXPERT] * 4
    assert manifest["dynamic"][0]["detail"]["lowering"] == "if"
    params_before = manifest["stats"]["params_before"]
    assert params_before == moe_parameter_count(NEVER_3)
    static = max(0.0, 1 - manifest["stats"]["params_after"] / params_before)
    assert static == 0.0  # nothing is zero statically

    hidden = moe_feeds(NEVER_3, 16, seed=4)["hidden"]
    result = engine.run({"hidden": hidden})
    assert list(result.outputs) == ["y"]
    np.testing.assert_allclose(result.outputs["y"], _reference(NEVER_3, hidden)[0], atol=1e-5)
    report = result.report
    assert report.skipped_paths == [f"{PATH}.experts.3"]
    assert report.skipped_params == PER_EXPERT
    assert report.zeroed_params_ratio == pytest.approx(PER_EXPERT / params_before)
    assert report.routing_confidence == pytest.approx(_confidence(NEVER_3, hidden), rel=1e-5)
    assert report.masks == {}

    one = hidden[:1]
    report = engine.run({"hidden": one}, masks=True).report
    w = moe_layer_weights(NEVER_3, 0)
    _, mask = moe_routing(one @ w["router"].T + w["router_bias"], top_k=2, normalize=True)
    idle = [f"{PATH}.experts.{e}" for e in range(4) if not mask[0, e]]
    assert len(idle) == 2 and report.skipped_paths == idle
    assert report.zeroed_params_ratio == pytest.approx(2 * PER_EXPERT / params_before)
    np.testing.assert_array_equal(report.masks[PATH], mask)
    assert report.routing_confidence == pytest.approx(_confidence(NEVER_3, one), rel=1e-5)
    assert "skipped 2 paths" in report.summary()


def test_threshold_zero_is_exact() -> None:
    config = MoEConfig(form="batched_mm", experts=6, top_k=3)
    options = CompileOptions(atol=1e-6, rtol=1e-6, shapes={"hidden": (32, 64)}, moe_lowering="if")  # a plain session
    result = compile_model(build_moe(config), options)
    assert result.verification.passed
    session = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), providers=["CPUExecutionProvider"])
    hidden = moe_feeds(config, 32, seed=9)["hidden"]
    y, mask = session.run(["y", f"layerzero::mask::{PATH}"], {"hidden": hidden})
    ref_y, ref_mask = _reference(config, hidden)
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_allclose(y, ref_y, atol=1e-6, rtol=1e-6)


def test_threshold_reports_deviation_and_bounds_it(tmp_path: Path) -> None:
    config = MoEConfig(form="unrolled", experts=6, top_k=3)
    proto = build_moe(config)
    options = dict(shapes={"hidden": (32, config.hidden)}, atol=1e-5, moe_lowering="if")  # a plain session below
    result = compile_model(proto, CompileOptions(zeroing_threshold=0.5, **options))
    deviation = result.verification.outputs[0].max_abs
    assert result.verification.passed and deviation > 1e-3  # reported, not failed
    session = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), providers=["CPUExecutionProvider"])
    hidden = moe_feeds(config, 32, seed=1)["hidden"]
    y, mask = session.run(["y", f"layerzero::mask::{PATH}"], {"hidden": hidden})
    ref_y, ref_mask = _reference(config, hidden, threshold=0.5)
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_allclose(y, ref_y, atol=1e-5)
    assert ref_mask.sum() < _reference(config, hidden)[1].sum()

    with pytest.raises(VerificationError):
        compile_model(proto, CompileOptions(zeroing_threshold=0.5, max_deviation=deviation / 2, **options))
    onnx.save(proto, tmp_path / "m.onnx")
    out = tmp_path / "m.lz"
    argv = ["compile", str(tmp_path / "m.onnx"), "-o", str(out), "--shape", f"hidden:32,{config.hidden}"]
    assert main([*argv, "--threshold", "0.5", "--max-deviation", f"{deviation / 2}"]) == 1
    assert not out.exists()
    assert main([*argv, "--threshold", "0.5", "--max-deviation", f"{deviation * 2}"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["zeroing_threshold"] == 0.5
    assert manifest["dynamic"][0]["detail"]["zeroing_threshold"] == 0.5


def test_run_time_threshold(bundle: Path) -> None:
    engine = Engine.load(bundle)
    assert engine.has_threshold_input
    hidden = moe_feeds(NEVER_3, 32, seed=6)["hidden"]
    for threshold in (0.0, 0.6):
        result = engine.run({"hidden": hidden}, threshold=threshold, masks=True)
        ref_y, ref_mask = _reference(NEVER_3, hidden, threshold=threshold)
        np.testing.assert_array_equal(result.report.masks[PATH], ref_mask)
        np.testing.assert_allclose(result.outputs["y"], ref_y, atol=1e-5)
