"""Group masks: groups of layers run exactly when their router value is on; spec errors name the problem."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import yaml

from layerzero.cli import main as cli_main
from layerzero.compile import compile_file, compile_model
from layerzero.errors import InvalidInputError
from layerzero.groups import load_group_spec, parse_group_spec
from layerzero.models import build_routed_example, build_transformer, routed_feeds
from layerzero.models.routed_groups import ROUTED_CONFIG, bypassed_blocks, embed_router
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import MASK_PREFIX, read_dynamic_paths
from layerzero.passes.group_masks import ApplyGroupMasks
from layerzero.passes.shape_inference import InferShapes
from layerzero.runtime import Engine
from tests import onnx_check

COMBOS = [(False, False), (False, True), (True, False), (True, True)]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "groups"


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model.onnx, router.onnx and spec.yaml of the shipped example, in a temp dir."""
    d = tmp_path_factory.mktemp("groups")
    model, router, spec = build_routed_example()
    onnx.save_model(model, d / "model.onnx")
    onnx.save_model(router, d / "router.onnx")
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return d


@pytest.fixture(scope="module")
def compiled(example: Path) -> Path:
    compile_file(example / "model.onnx", example / "model.lz", CompileOptions(groups=example / "spec.yaml"))
    return example / "model.lz"


def _oracle(vision: bool, audio: bool) -> onnx.ModelProto:
    """The original model with the off groups' blocks not there at all."""
    return build_transformer(dataclasses.replace(ROUTED_CONFIG, omit_blocks=bypassed_blocks(vision, audio)))


def _run(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _spec(example: Path, **changes: object) -> dict:
    spec = yaml.safe_load((example / "spec.yaml").read_text())
    spec.update(changes)
    return spec


def _apply(example: Path, spec: dict, model: onnx.ModelProto | None = None) -> ir.Model:
    ir_model = ir.from_proto(model if model is not None else onnx.load(example / "model.onnx"))
    InferShapes()(ir_model)
    ApplyGroupMasks(parse_group_spec(spec, base_dir=example, source="spec.yaml"))(ir_model)
    return ir_model


@pytest.mark.parametrize(("vision", "audio"), COMBOS)
def test_each_group_is_skipped_exactly_when_its_router_value_is_off(compiled: Path, vision: bool, audio: bool) -> None:
    engine = Engine.load(compiled)
    assert engine.output_names == ["logits"]
    feeds = routed_feeds(vision, audio, batch=1, seq=5)
    result = engine.run(feeds, masks=True)
    off = [name for name, on in (("vision", vision), ("audio", audio)) if not on]
    assert result.report.skipped_paths == off
    assert {k: bool(v) for k, v in result.report.masks.items()} == {"vision": vision, "audio": audio}
    want = _run(_oracle(vision, audio), feeds)["logits"]
    np.testing.assert_allclose(result.outputs["logits"], want, atol=1e-5, rtol=1e-5)
    if off:
        assert result.report.zeroed_params_ratio > 0


def test_compile_records_groups_and_verifies_against_the_bypassed_reference(compiled: Path) -> None:
    manifest = json.loads((compiled / "manifest.json").read_text())
    dynamic = {d["path"]: d for d in manifest["dynamic"]}
    assert {p: (d["kind"], d["subpaths"], d["mask_output"]) for p, d in dynamic.items()} == {
        "vision": ("group", ["vision"], MASK_PREFIX + "vision"),
        "audio": ("group", ["audio"], MASK_PREFIX + "audio"),
    }
    per_block = manifest["stats"]["params_before"] - onnx_params(_oracle(True, False))  # block 3's parameters
    assert dynamic["audio"]["params"] == [per_block]
    assert dynamic["vision"]["params"] == [2 * per_block]
    verification = manifest["verification"]
    assert verification["passed"] and verification["needed_atol"] == 0.0
    assert verification["impact"] is not None  # the groups' measured effect on the sample inputs
    model = onnx.load(compiled / "model.onnx")
    ifs = [n.name for n in model.graph.node if n.op_type == "If"]
    assert ifs == ["/layers.1/LzGroupIf", "/layers.2/LzGroupIf", "/layers.3/LzGroupIf"]
    onnx_check.check_model(model)


def onnx_params(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


def test_router_as_a_graph_output_of_the_model(example: Path) -> None:
    model, router, _ = build_routed_example()
    with_router = embed_router(model, router, "router_scores")
    spec = _spec(example, router={"output": "router_scores"})
    compiled = _apply(example, spec, with_router)
    outputs = ["logits", "router_scores", MASK_PREFIX + "vision", MASK_PREFIX + "audio"]
    assert [o.name for o in compiled.graph.outputs] == outputs
    for vision, audio in COMBOS:
        feeds = routed_feeds(vision, audio)
        got = _run(compiled, feeds)
        np.testing.assert_allclose(got["logits"], _run(_oracle(vision, audio), feeds)["logits"], atol=1e-5, rtol=1e-5)
        assert (bool(got[MASK_PREFIX + "vision"]), bool(got[MASK_PREFIX + "audio"])) == (vision, audio)
    # A second run changes nothing.
    assert not ApplyGroupMasks(parse_group_spec(spec, base_dir=example))(compiled).modified


def test_a_switched_off_group_does_not_run(example: Path, tmp_path: Path) -> None:
    compiled = _apply(example, _spec(example))
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        ir.to_proto(compiled).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    session.run(None, routed_feeds(vision=True, audio=False))
    events = json.loads(Path(session.end_profiling()).read_text())
    ran = {e["name"] for e in events if e.get("cat") == "Node"}
    assert any(n.startswith("/layers.1/") and "MatMul" in n for n in ran)  # vision on
    assert not any(n.startswith("/layers.3/") and "MatMul" in n for n in ran)  # audio off


def test_shipped_example_spec_matches_the_builder() -> None:
    _, _, spec = build_routed_example()
    assert yaml.safe_load((EXAMPLES / "spec.yaml").read_text()) == spec
    assert "--groups spec.yaml" in (EXAMPLES / "README.md").read_text().replace("examples/groups/", "")


def test_cli_compile_with_groups(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.lz"
    assert (
        cli_main(["compile", str(example / "model.onnx"), "-o", str(out), "--groups", str(example / "spec.yaml")]) == 0
    )
    assert {d["path"] for d in json.loads((out / "manifest.json").read_text())["dynamic"]} == {"vision", "audio"}
    missing = tmp_path / "missing.yaml"
    assert (
        cli_main(["compile", str(example / "model.onnx"), "-o", str(tmp_path / "x.lz"), "--groups", str(missing)]) == 2
    )
    assert not (tmp_path / "x.lz").exists()


# ------------------------------------------------------------------------------------------- spec errors


def _write(tmp_path: Path, spec: object, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router": {"model": "nope.onnx"}}, "router model .*nope.onnx not found"),
        ({"router": {"output": "a", "model": "router.onnx"}}, "exactly one of 'output'"),
        ({"router": {"model": "router.onnx", "output_name": "scores", "extra": 1}}, "unknown key.*'extra'"),
        ({"threshold": "high"}, "threshold must be a number"),
        ({"groups": []}, "groups must be a non-empty list"),
        ({"groups": [{"name": "a", "scopes": ["layers.1"], "index": -1}]}, "index must be a non-negative"),
        ({"groups": [{"name": "a", "scopes": ["layers.1"]}, {"name": "a", "scopes": ["layers.2"]}]}, "used twice"),
        ({"groups": [{"name": "a", "scopes": []}]}, "scopes must be a non-empty list"),
        ({"grops": []}, "unknown key.*'grops'"),
    ],
)
def test_spec_errors_name_the_problem(example: Path, change: dict, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_group_spec(_spec(example, **change), base_dir=example, source="spec.yaml")


def test_spec_file_errors(example: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"missing\.yaml: group spec not found"):
        load_group_spec(tmp_path / "missing.yaml")
    with pytest.raises(InvalidInputError, match="not valid YAML"):
        load_group_spec(_write(tmp_path, "groups: [unclosed"))
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        load_group_spec(_write(tmp_path, "{", "spec.json"))
    # JSON works too, and the router is read relative to the spec file.
    spec = load_group_spec(_write(example, json.dumps(_spec(example)), "spec.json"))
    assert [g.name for g in spec.groups] == ["vision", "audio"] and spec.router.model is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"groups": [{"name": "a", "scopes": ["layers.9"], "index": 0}]}, "group 'a': no node has scope 'layers.9'"),
        ({"groups": [{"name": "a", "scopes": ["layers.1"], "index": 2}]}, "index 2 is out of range"),
        ({"router": {"model": "router.onnx", "output_name": "logits"}}, "router model has no output 'logits'"),
        ({"router": {"output": "router_scores"}}, "router output 'router_scores' is not a value of the model"),
        (
            {"groups": [{"name": "a", "scopes": ["layers.1"]}, {"name": "b", "scopes": ["layers.1.mlp"]}]},
            "overlaps scope 'layers.1'",
        ),
        ({"groups": [{"name": "a", "scopes": ["rotary_emb"]}]}, "scope 'rotary_emb' has 2 outputs"),
    ],
)
def test_spec_errors_against_the_model(example: Path, change: dict, message: str) -> None:
    before = onnx.load(example / "model.onnx")
    with pytest.raises(InvalidInputError, match=message):
        _apply(example, _spec(example, **change), before)


def test_router_inputs_must_be_model_inputs(example: Path, tmp_path: Path) -> None:
    router = onnx.load(example / "router.onnx")
    router.graph.input[0].name = "token_ids"
    for node in router.graph.node:
        node.input[:] = ["token_ids" if n == "input_ids" else n for n in node.input]
    onnx.save_model(router, tmp_path / "router.onnx")
    spec = _spec(example)
    with pytest.raises(InvalidInputError, match="router input 'token_ids' is not an input of the model"):
        _apply(tmp_path, spec, onnx.load(example / "model.onnx"))


def test_router_that_reads_a_grouped_layer_is_refused(example: Path) -> None:
    # The "router" is a value computed inside layers.1: a group cannot be switched by its own output.
    model = ir.from_proto(onnx.load(example / "model.onnx"))
    inner = next(n for n in model.graph if n.name.startswith("/layers.1/mlp/")).outputs[0].name
    spec = _spec(example, router={"output": inner}, groups=[{"name": "a", "scopes": ["layers.1"], "index": 0}])
    with pytest.raises(InvalidInputError, match="a router must not depend on the layers it switches"):
        _apply(example, spec)


def test_compile_without_groups_is_unchanged(example: Path) -> None:
    result = compile_model(onnx.load(example / "model.onnx"))
    assert not [d for d in read_dynamic_paths(result.model) if d.kind == "group"]


SIDE_TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
side (float[N, 4] x, float[2] r) => (float[N, 4] y) <float[4, 4] w0 = {W0}, float[4, 4] w1 = {W1}, float[4] c = {C}> {
  ["/layers.0/table/Cos"] t = Cos(c)
  ["/layers.0/MatMul"] a = MatMul(x, w0)
  ["/layers.0/Add"] h = Add(a, t)
  ["/layers.0/Add_1"] o0 = Add(x, h)
  ["/layers.1/MatMul"] b = MatMul(o0, w1)
  ["/layers.1/Mul"] m = Mul(b, t)
  ["/layers.1/Add"] y = Add(o0, m)
}
"""


@pytest.mark.parametrize("on", [True, False])
def test_side_values_of_a_grouped_layer_keep_running(on: bool) -> None:
    # layers.0 also computes the table t that layers.1 reads (torch.onnx puts shared tables in the first
    # layer's scope): only the rest of layers.0 is switched; t is computed either way.
    rng = np.random.default_rng(1)
    w0, w1, c = (np.round(rng.standard_normal(shape), 5) for shape in ((4, 4), (4, 4), 4))

    def values(a: np.ndarray) -> str:
        return "{" + ", ".join(f"{v:.5f}" for v in a.reshape(-1)) + "}"

    text = SIDE_TEXT.replace("{W0}", values(w0)).replace("{W1}", values(w1)).replace("{C}", values(c))
    model = ir.from_onnx_text(text)
    InferShapes()(model)
    spec = parse_group_spec({"router": {"output": "r"}, "groups": [{"name": "first", "scopes": ["layers.0"]}]})
    assert ApplyGroupMasks(spec)(model).modified
    onnx_check.check_model(ir.to_proto(model))
    assert [n.op_type for n in model.graph if n.name.startswith("/layers.0/")] == ["Cos", "If"]
    x = rng.standard_normal((3, 4)).astype(np.float32)
    got = _run(model, {"x": x, "r": np.array([0.9 if on else 0.1, 0.0], np.float32)})
    f32 = [a.astype(np.float32) for a in (w0, w1, c)]
    t = np.cos(f32[2])
    o0 = x + (x @ f32[0] + t) if on else x
    np.testing.assert_allclose(got["y"], o0 + (o0 @ f32[1]) * t, atol=1e-5, rtol=1e-5)
    assert bool(got[MASK_PREFIX + "first"]) == on
