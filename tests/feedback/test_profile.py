"""Profile: exact counts and stability on hand-made traffic, impact of forcing a path off, the variant pass,
the profile document and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.calibration import load_requests, profile_bundle
from layerzero.cli import main
from layerzero.compile import compile_file
from layerzero.models import TransformerConfig, build_gated_model, build_transformer, example_feeds, gated_feeds
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.passes.force_off import BLOCK_PREFIX, FORCE_OFF_PREFIX, ExposeForceOff
from layerzero.runtime import Engine, sha256_file
from layerzero.runtime.path_stats import PROFILE_FORMAT, PROFILE_VERSION, PathStats, load_profile


def _longest_skip(ran: list[bool]) -> int:
    best = run = 0
    for r in ran:
        run = 0 if r else run + 1
        best = max(best, run)
    return best


def test_counts_and_stability_are_exact(moe_case, fb) -> None:
    masks = fb.expected_masks(moe_case.requests)
    doc = moe_case.doc
    assert doc["traffic"] == {"requests": 6, "tokens": sum(fb.TOKENS), "data": str(moe_case.data)}
    # Expert 3: never routed. Expert 2: exactly the first token of the odd requests (1, 3, 5).
    three = fb.record(doc, f"{fb.PATH}.experts.3")
    assert three["tokens"] == {"run": 0, "skipped": 21} and three["requests"] == {"run": 0, "skipped": 6}
    assert three["zeroing_stability"] == {"tokens": 21, "requests": 6}
    two = fb.record(doc, f"{fb.PATH}.experts.2")
    assert two["tokens"] == {"run": 3, "skipped": 18} and two["requests"] == {"run": 3, "skipped": 3}
    # Skip runs in tokens: 3 (request 0), 4 + 2 = 6 (after request 1's first token), 3 + 6 = 9, 0.
    assert two["zeroing_stability"] == {"tokens": 9, "requests": 1}
    assert [m[:, 2].sum() for m in masks] == [0, 1, 0, 1, 0, 1]
    # Every expert against numpy's routing of the same traffic.
    for e in range(fb.CONFIG.experts):
        rec = fb.record(doc, f"{fb.PATH}.experts.{e}")
        ran = np.concatenate([m[:, e] for m in masks])
        per_request = [bool(m[:, e].any()) for m in masks]
        assert rec["kind"] == "moe" and rec["parent"] == fb.PATH and rec["index"] == e
        assert rec["params"] == 3 * fb.CONFIG.hidden * fb.CONFIG.ffn
        assert rec["tokens"] == {"run": int(ran.sum()), "skipped": int((~ran).sum())}
        assert rec["requests"] == {"run": sum(per_request), "skipped": 6 - sum(per_request)}
        assert rec["zeroing_stability"] == {"tokens": _longest_skip(list(ran)), "requests": _longest_skip(per_request)}


def test_impact_of_forcing_off(moe_case, fb) -> None:
    never = fb.record(moe_case.doc, f"{fb.PATH}.experts.3")["zeroing_impact"]
    assert never["model"] == 0.0 and never["block"] == 0.0 and never["samples"] == fb.IMPACT_SAMPLES
    used = fb.record(moe_case.doc, f"{fb.PATH}.experts.2")["zeroing_impact"]
    # Requests 1 and 3 of the 4 sampled route their first token to expert 2.
    assert used["model"] > 0.01 and used["block"] > 0.01 and 0 < used["model_mean"] < used["model"]
    assert used["source"] == "measured"
    assert moe_case.doc["impact"]["samples"] == fb.IMPACT_SAMPLES


def test_document_names_its_models(moe_case) -> None:
    doc = load_profile(moe_case.profile)
    assert doc["format"] == PROFILE_FORMAT and doc["version"] == PROFILE_VERSION
    assert doc["bundle"]["model_sha256"] == sha256_file(moe_case.bundle / "model.onnx")
    assert doc["source"]["sha256"] == sha256_file(moe_case.model)
    json.dumps(doc, allow_nan=False)  # strict JSON


def test_force_off_variant_pass(moe_case, fb) -> None:
    model = ir.load(moe_case.bundle / "model.onnx")
    result = ExposeForceOff()(model)
    assert result.modified
    assert not ExposeForceOff()(model).modified  # a second run changes nothing
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    inputs = {v.name: v for v in model.graph.inputs}
    force = inputs[FORCE_OFF_PREFIX + fb.PATH]
    assert force.dtype == ir.DataType.BOOL and list(force.shape) == [fb.CONFIG.experts]
    assert BLOCK_PREFIX + fb.PATH in [v.name for v in model.graph.outputs]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    engine = Engine.load(moe_case.bundle)
    names = [o.name for o in session.get_outputs()]
    for feeds, mask in zip(moe_case.requests, fb.expected_masks(moe_case.requests)):
        off = np.zeros(fb.CONFIG.experts, bool)
        got = dict(zip(names, session.run(None, {**feeds, FORCE_OFF_PREFIX + fb.PATH: off})))
        np.testing.assert_array_equal(got["y"], engine.run(feeds).outputs["y"])  # nothing forced: the bundle
        off[0] = True
        forced = dict(zip(names, session.run(None, {**feeds, FORCE_OFF_PREFIX + fb.PATH: off})))
        assert not forced[f"layerzero::mask::{fb.PATH}"][:, 0].any()
        assert forced[f"layerzero::mask::{fb.PATH}"].sum(-1).tolist() == [2] * len(mask)  # still top-2


def test_impact_is_the_same_on_the_ort_moe_lowering(moe_case, fb, tmp_path: Path) -> None:
    compile_file(moe_case.model, tmp_path / "ort.lz", CompileOptions(moe_lowering="ort-moe"))
    assert Engine.load(tmp_path / "ort.lz").manifest["dynamic"][0]["detail"]["lowering"] == "ort-moe"
    doc = profile_bundle(tmp_path / "ort.lz", moe_case.requests, impact_samples=fb.IMPACT_SAMPLES)
    for p in doc["paths"]:
        want = fb.record(moe_case.doc, p["path"])
        assert p["tokens"] == want["tokens"]
        for key in ("block", "model"):
            assert p["zeroing_impact"][key] == pytest.approx(want["zeroing_impact"][key], rel=1e-4, abs=1e-6)


def test_gates_count_per_token_and_force_off(tmp_path: Path) -> None:
    onnx.save(build_gated_model("token", num_layers=2), tmp_path / "gated.onnx")
    compile_file(tmp_path / "gated.onnx", tmp_path / "gated.lz")
    rng = np.random.default_rng(0)
    gate_1 = [rng.standard_normal((2, 3)) for _ in range(3)]
    requests = [gated_feeds((2, 3), [-np.ones((2, 3)), g], kind="token", seed=r) for r, g in enumerate(gate_1)]
    doc = profile_bundle(tmp_path / "gated.lz", requests, impact_samples=3)
    off, on = (next(p for p in doc["paths"] if p["path"] == f"layers.{i}.mlp") for i in (0, 1))
    assert doc["traffic"]["tokens"] == 18  # [batch 2, seq 3] per request
    assert off["kind"] == "gate" and off["tokens"] == {"run": 0, "skipped": 18}
    assert off["zeroing_stability"] == {"tokens": 18, "requests": 3} and off["zeroing_impact"]["model"] == 0.0
    ran = np.concatenate([g.reshape(-1) > 0 for g in gate_1])
    assert on["tokens"] == {"run": int(ran.sum()), "skipped": int((~ran).sum())}
    assert on["zeroing_stability"]["tokens"] == _longest_skip(list(ran))
    assert on["zeroing_impact"]["model"] > 0 and on["zeroing_impact"]["block"] > 0


def test_statically_removed_layers_are_always_skipped(tmp_path: Path) -> None:
    config = TransformerConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, ffn=32, zero_blocks=(1,))
    onnx.save(build_transformer(config), tmp_path / "t.onnx")
    compile_file(tmp_path / "t.onnx", tmp_path / "t.lz")
    requests = [example_feeds(config, seq=s, seed=s) for s in (3, 5)]
    doc = profile_bundle(tmp_path / "t.lz", requests, impact_samples=2)
    removed = Engine.load(tmp_path / "t.lz").manifest["removed"]
    static = [p for p in doc["paths"] if p["kind"] == "static"]
    assert {p["path"] for p in static} == {r["scope"] for r in removed} and static
    for p in static:
        assert p["tokens"] == {"run": 0, "skipped": 8} and p["requests"] == {"run": 0, "skipped": 2}
        assert p["zeroing_stability"] == {"tokens": 8, "requests": 2}
        assert p["zeroing_impact"]["source"] in ("verification", "exact")


def test_path_stats_carry_runs_across_requests() -> None:
    stats = PathStats("p", "p", "gate")
    stats.add(np.array([True, False, False]), 3)
    stats.add(np.array(False), 4)  # a per-request decision: all 4 tokens
    stats.add(np.array([False, True]), 2)
    assert stats.stability_tokens == 2 + 4 + 1 and stats.stability_requests == 1
    assert (stats.tokens_run, stats.tokens_skipped, stats.requests_run, stats.requests_skipped) == (2, 7, 2, 1)


def test_cli_profile(moe_case, fb, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", str(moe_case.bundle), "--data", str(moe_case.data), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    for p in doc["paths"]:
        assert {k: p[k] for k in ("tokens", "requests", "zeroing_stability")} == {
            k: fb.record(moe_case.doc, p["path"])[k] for k in ("tokens", "requests", "zeroing_stability")
        }
    assert f"{fb.PATH}.experts.3" in capsys.readouterr().out
    # One .npz with a leading request axis: the same requests, when they have one shape.
    same = [{"hidden": r["hidden"][:1]} for r in moe_case.requests]
    np.savez(tmp_path / "calib.npz", hidden=np.stack([r["hidden"] for r in same]))
    assert [r["hidden"].shape for r in load_requests(tmp_path / "calib.npz")] == [(1, fb.CONFIG.hidden)] * 6
    assert main(["profile", str(moe_case.bundle), "--data", str(tmp_path / "calib.npz"), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traffic"]["requests"] == 6


def test_cli_profile_bad_input(moe_case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", str(moe_case.bundle), "--data", str(tmp_path / "missing.npz")]) == 2
    assert "calibration data not found" in capsys.readouterr().err
    np.savez(tmp_path / "ragged.npz", hidden=np.zeros((2, 3, 16), np.float32), other=np.zeros((3, 1)))
    assert main(["profile", str(moe_case.bundle), "--data", str(tmp_path / "ragged.npz")]) == 2
    assert "leading request axis" in capsys.readouterr().err
    assert main(["profile", str(moe_case.model), "--data", str(moe_case.data)]) == 2
    assert "not a bundle" in capsys.readouterr().err
    assert [p.kind for p in read_dynamic_paths(ir.load(moe_case.bundle / "model.onnx"))] == ["moe"]
