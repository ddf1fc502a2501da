"""Solidify: compile --profile removes exactly the stable, harmless paths, verifies, and keeps the outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from layerzero.calibration import profile_bundle
from layerzero.cli import main
from layerzero.compile import compile_file, compile_model
from layerzero.errors import InvalidInputError
from layerzero.models import build_gated_model, gated_feeds
from layerzero.models.moe import moe_layer_weights
from layerzero.options import CompileOptions
from layerzero.runtime import Engine


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(_all_nodes(attr.g))
    return nodes


def _expert_nodes(model: onnx.ModelProto, scope: str) -> int:
    """Nodes the `if` lowering makes for one expert: its main-graph nodes and everything inside its If."""
    return sum(len(_all_nodes(onnx.helper.make_graph([n], "g", [], []))) for n in model.graph.node if scope in n.name)


def _original(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(scope="module")
def solid(moe_case, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("solid") / "solid.lz"
    options = CompileOptions(profile=moe_case.profile, stability_window=len(moe_case.requests), moe_lowering="if")
    compile_file(moe_case.model, out, options)
    return out


def test_removes_exactly_the_never_routed_expert(moe_case, fb, solid: Path) -> None:
    manifest = Engine.load(solid).manifest
    plain = Engine.load(moe_case.bundle).manifest
    (gone,) = manifest["solidified"]
    h, f = fb.CONFIG.hidden, fb.CONFIG.ffn
    per_expert = 3 * h * f
    assert gone["subpath"] == f"{fb.PATH}.experts.3" and gone["kind"] == "moe" and gone["path"] == fb.PATH
    assert gone["params"] == per_expert + h + 1  # its weights, its router row and bias entry
    assert gone["stability"] == {"tokens": 21, "requests": 6} and gone["impact"]["model"] == 0.0
    # Parameters: exactly the expert and its router row; nodes: exactly the expert's lowering.
    assert plain["stats"]["params_after"] - manifest["stats"]["params_after"] == per_expert + h + 1
    plain_model = onnx.load(str(moe_case.bundle / "model.onnx"))
    expert_nodes = _expert_nodes(plain_model, f"/{fb.PATH}.experts.3/")
    assert expert_nodes > 3
    assert plain["stats"]["nodes_after"] - manifest["stats"]["nodes_after"] == expert_nodes
    # The never-routed expert's weights are gone: no initializer holds them; the router has 3 rows.
    model = onnx.load(str(solid / "model.onnx"))
    weights = moe_layer_weights(fb.CONFIG, 0)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    gate_up = [a for n, a in arrays.items() if n.endswith("gate_up_proj")]
    assert len(gate_up) == 3
    assert not any(np.array_equal(a[:, :f], weights["w_gate"][3].T) for a in gate_up)
    assert all(any(np.array_equal(a[:, :f], weights["w_gate"][e].T) for a in gate_up) for e in range(3))
    assert arrays[f"{fb.PATH}.gate.weight"].shape == (3, h)
    np.testing.assert_array_equal(arrays[f"{fb.PATH}.gate.bias"], np.zeros(3, np.float32))
    (entry,) = manifest["dynamic"]
    assert entry["subpaths"] == [f"{fb.PATH}.experts.{e}" for e in range(3)]
    assert entry["detail"]["solidified"] == [f"{fb.PATH}.experts.3"]


def test_verifies_and_keeps_the_outputs(moe_case, solid: Path) -> None:
    manifest = Engine.load(solid).manifest
    verification = manifest["verification"]
    assert verification["passed"]
    assert [o["max_abs"] for o in verification["impact"]] == [0.0]  # never routed: removing it changes nothing
    assert manifest["options"]["solidify"] == ["layers.0.moe.experts.3"]
    engine, plain = Engine.load(solid), Engine.load(moe_case.bundle)
    for feeds in moe_case.requests:
        (want,) = _original(moe_case.model, feeds)
        got = engine.run(feeds, masks=True)
        np.testing.assert_allclose(got.outputs["y"], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got.outputs["y"], plain.run(feeds).outputs["y"])
        assert got.report.masks["layers.0.moe"].shape == (feeds["hidden"].shape[0], 3)


def test_window_and_tolerance_decide(moe_case, fb) -> None:
    def removed(**changes: object) -> list[str]:
        options = CompileOptions(profile=moe_case.profile, **changes)
        return [r["subpath"] for r in compile_model(moe_case.model, options).solidified]

    assert removed(stability_window=7) == []  # longer than the traffic
    assert removed(stability_window=6, impact_tolerance=0.0) == []  # impact 0 is not below 0
    # In tokens, expert 2 is stable for 9: a candidate, but its impact is above the tolerance.
    tokens = compile_model(
        moe_case.model, CompileOptions(profile=moe_case.profile, stability_window=9, stability_unit="tokens")
    )
    assert [r["subpath"] for r in tokens.solidified] == [f"{fb.PATH}.experts.3"]
    ((subpath, reason),) = [(c.subpath, c.reason) for c in tokens.solidify_plan.kept]
    assert subpath == f"{fb.PATH}.experts.2" and reason.startswith("impact ") and "tolerance 0.01" in reason
    # Window 1 makes experts 1, 2 and 3 stable enough; top-2 of 4 leaves room for two: the smallest impacts go.
    result = compile_model(
        moe_case.model, CompileOptions(profile=moe_case.profile, stability_window=1, impact_tolerance=10)
    )
    assert sorted(r["subpath"] for r in result.solidified) == [f"{fb.PATH}.experts.2", f"{fb.PATH}.experts.3"]
    stable = [p["path"] for p in moe_case.doc["paths"] if p["zeroing_stability"]["requests"] >= 1]
    assert len(stable) > 2
    kept = {c.subpath: c.reason for c in result.solidify_plan.kept}
    assert kept == {p: f"{fb.PATH} keeps at least top_k=2 experts" for p in stable if p not in result.options.solidify}
    assert result.verification.passed  # against the original with experts 2 and 3 forced off
    assert result.verification.impact[0].max_abs > 0  # expert 2 did route random tokens


def test_mismatched_profile_is_rejected(moe_case, fb, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.onnx"
    onnx.save(fb.designed_moe(dataclasses.replace(fb.CONFIG, seed=1)), other)
    out = tmp_path / "out.lz"
    code = main(["compile", str(other), "-o", str(out), "--profile", str(moe_case.profile)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "profile belongs to another model" in err and str(moe_case.profile) in err
    (tmp_path / "junk.json").write_text("{}")
    assert main(["compile", str(moe_case.model), "-o", str(out), "--profile", str(tmp_path / "junk.json")]) == 2
    assert "not a LayerZero profile" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="not a dynamic path of this compile"):
        compile_model(moe_case.model, CompileOptions(solidify=("layers.9.moe.experts.0",)))


def test_cli_compile_with_profile(moe_case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.lz"
    args = ["compile", str(moe_case.model), "-o", str(out), "--profile", str(moe_case.profile)]
    assert main([*args, "--stability-window", "6", "--impact-tolerance", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "solidified layers.0.moe.experts.3" in text and "verification  passed" in text
    assert json.loads((out / "manifest.json").read_text())["options"]["stability_window"] == 6


def test_gated_branch_takes_its_else_path(tmp_path: Path) -> None:
    onnx.save(build_gated_model("token", num_layers=2), tmp_path / "g.onnx")
    compile_file(tmp_path / "g.onnx", tmp_path / "g.lz")
    rng = np.random.default_rng(3)
    requests = [
        gated_feeds((1, 4), [-np.ones((1, 4)), rng.standard_normal((1, 4))], kind="token", seed=r) for r in range(4)
    ]
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(profile_bundle(tmp_path / "g.lz", requests, impact_samples=2)))
    result = compile_file(tmp_path / "g.onnx", tmp_path / "s.lz", CompileOptions(profile=profile, stability_window=4))
    manifest = Engine.load(tmp_path / "s.lz").manifest
    plain = Engine.load(tmp_path / "g.lz").manifest
    assert [r["subpath"] for r in result.solidified] == ["layers.0.mlp"]
    assert [d["path"] for d in manifest["dynamic"]] == ["layers.1.mlp"]
    assert {"scope": "layers.0", "kind": "solidified"}.items() <= manifest["removed"][0].items()
    mlp_params = plain["dynamic"][0]["params"][0]
    assert manifest["removed"][0]["params"] == mlp_params == result.solidified[0]["params"]
    # The bundle also loses the few index constants the gated rewrite added for that branch.
    assert mlp_params <= plain["stats"]["params_after"] - manifest["stats"]["params_after"] <= mlp_params + 8
    model = onnx.load(str(tmp_path / "s.lz" / "model.onnx"))
    assert [n.op_type for n in model.graph.node].count("If") == 1
    assert [o.name for o in model.graph.output] == ["y", "layerzero::mask::layers.1.mlp"]
    engine = Engine.load(tmp_path / "s.lz")
    for feeds in requests:
        (want,) = _original(tmp_path / "g.onnx", feeds)
        np.testing.assert_allclose(engine.run(feeds).outputs["y"], want, rtol=1e-5, atol=1e-6)
