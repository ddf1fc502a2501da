"""SkipGatedBranches: ``x + g * f(x)`` runs f only where the gate is on; outputs equal the original's."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.compile import compile_file, compile_model
from layerzero.errors import VerificationError
from layerzero.models import build_gated_model, gated_feeds
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import MASK_PREFIX, THRESHOLD_INPUT, read_dynamic_paths
from layerzero.passes.gated_branches import SkipGatedBranches, read_refused_branches
from layerzero.passes.shape_inference import InferShapes
from layerzero.runtime import Engine

RNG = np.random.default_rng(0)
W1 = ", ".join(f"{v:.4f}" for v in RNG.standard_normal(32))
W2 = ", ".join(f"{v:.4f}" for v in RNG.standard_normal(32))

# One scalar-gated branch; the gate is computed (Relu of an input), so it is not a static constant.
SCALAR_TEXT = f"""
<ir_version: 10, opset_import: ["" : 18]>
gated (float[T, 4] x, float logit) => (float[T, 4] y)
<float[4, 8] w1 = {{{W1}}}, float[8, 4] w2 = {{{W2}}}> {{
  ["/block/gate/Relu"] g = Relu(logit)
  ["/block/mlp/up/MatMul"] h1 = MatMul(x, w1)
  ["/block/mlp/act/Relu"] h2 = Relu(h1)
  ["/block/mlp/down/MatMul"] h = MatMul(h2, w2)
  ["/block/Mul"] m = Mul(h, g)
  ["/block/Add"] y = Add(m, x)
}}
"""
BRANCH = ["/block/mlp/up/MatMul", "/block/mlp/act/Relu", "/block/mlp/down/MatMul"]


def _infer(model: ir.Model) -> None:
    InferShapes()(model)


def _apply(model: ir.Model, threshold: float = 0.0) -> tuple[SkipGatedBranches, ir.passes.PassResult]:
    _infer(model)
    p = SkipGatedBranches(threshold=threshold)
    return p, p(model)


def _session(model: ir.Model | onnx.ModelProto, profile: Path | None = None) -> ort.InferenceSession:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile is not None:
        options.enable_profiling = True
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep node names
        options.profile_file_prefix = str(profile)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}
    values = session.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in session.get_outputs()], values))


def _executed(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> set[str]:
    """Names of the nodes ORT ran (profiling events ``<name>_kernel_time``)."""
    _run(session, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    return {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"}


def test_scalar_gate_moves_the_branch_into_an_if() -> None:
    model = ir.from_onnx_text(SCALAR_TEXT)
    before = Counter(n.op_type for n in model.graph)
    p, result = _apply(model)
    assert result.modified
    after = Counter(n.op_type for n in model.graph)
    # The branch (2 MatMul, Relu) and Mul/Add leave the main graph; Abs, Greater and If come in.
    assert after - before == Counter({"Abs": 1, "Greater": 1, "If": 1})
    assert before - after == Counter({"MatMul": 2, "Relu": 1, "Mul": 1, "Add": 1})
    (if_node,) = [n for n in model.graph if n.op_type == "If"]
    then_ops = [n.name for n in if_node.attributes["then_branch"].as_graph()]
    assert then_ops == [*BRANCH, "/block/Mul", "/block/Add"]
    assert [o.name for o in model.graph.outputs] == ["y", MASK_PREFIX + "block.mlp"]
    (entry,) = read_dynamic_paths(model)
    assert (entry.path, entry.kind, entry.subpaths, entry.params) == ("block.mlp", "gate", ("block.mlp",), (64,))
    assert entry.mask_output == MASK_PREFIX + "block.mlp"
    assert [e.path for e in p.skipped] == ["block.mlp"]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    _, again = _apply(model)
    assert not again.modified


@pytest.mark.parametrize("logit", [1.5, 0.0, -2.0])
def test_scalar_gate_output_equals_the_original(logit: float) -> None:
    original = ir.to_proto(ir.from_onnx_text(SCALAR_TEXT))
    model = ir.from_onnx_text(SCALAR_TEXT)
    _apply(model)
    feeds = {"x": RNG.standard_normal((5, 4)).astype(np.float32), "logit": np.array(logit, np.float32)}
    want = _run(_session(original), feeds)["y"]
    got = _run(_session(model), feeds)
    np.testing.assert_allclose(got["y"], want, atol=1e-6, rtol=0)
    assert bool(got[MASK_PREFIX + "block.mlp"]) == (logit > 0)
    assert got[MASK_PREFIX + "block.mlp"].shape == ()


@pytest.mark.parametrize("kind", ["scalar", "token"])
@pytest.mark.parametrize("case", ["on", "off", "mixed"])
def test_gated_model_equals_the_original(kind: str, case: str) -> None:
    shape = [2, 5]
    proto = build_gated_model(kind, num_layers=2)
    model = ir.from_proto(proto)
    _, result = _apply(model)
    assert result.modified
    assert [e.path for e in read_dynamic_paths(model)] == ["layers.0.mlp", "layers.1.mlp"]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    if kind == "scalar":
        gates = {"on": [1.0, 0.5], "off": [-1.0, 0.0], "mixed": [1.0, -1.0]}[case]
    else:
        on, off = np.ones(shape), -np.ones(shape)
        mixed = np.where(RNG.random(shape) > 0.5, 1.0, -1.0)
        gates = {"on": [on, on], "off": [off, off], "mixed": [mixed, off]}[case]
    feeds = gated_feeds(shape, gates, kind=kind)
    want = _run(_session(proto), feeds)["y"]
    got = _run(_session(model), feeds)
    np.testing.assert_allclose(got["y"], want, atol=1e-6, rtol=0)
    for i in range(2):
        mask = got[MASK_PREFIX + f"layers.{i}.mlp"]
        expected = feeds[f"gate_{i}"] > 0
        np.testing.assert_array_equal(mask, expected if kind == "scalar" else expected[..., 0])


def test_token_gate_on_two_dimensional_tokens() -> None:
    proto = build_gated_model("token", num_layers=1, token_dims=["T"])
    model = ir.from_proto(proto)
    _apply(model)
    gates = [np.array([1.0, -1.0, 0.0, 2.0, -0.5, 0.3])]
    feeds = gated_feeds([6], gates, kind="token")
    got = _run(_session(model), feeds)
    np.testing.assert_allclose(got["y"], _run(_session(proto), feeds)["y"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got[MASK_PREFIX + "layers.0.mlp"], gates[0] > 0)
    # Tokens whose gate is off are the residual stream, untouched.
    off = gates[0] <= 0
    np.testing.assert_array_equal(got["y"][off], feeds["x"][off])


@pytest.mark.parametrize("kind", ["scalar", "token"])
def test_branch_nodes_do_not_run_when_the_gate_is_off(kind: str, tmp_path: Path) -> None:
    model = ir.from_proto(build_gated_model(kind, num_layers=2))
    _apply(model)
    shape = [1, 4]
    off, on = (-1.0, 1.0) if kind == "scalar" else (-np.ones(shape), np.ones(shape))
    feeds = gated_feeds(shape, [off, on], kind=kind)
    ran = _executed(_session(model, tmp_path / "profile"), feeds)
    original = ir.from_proto(build_gated_model(kind, num_layers=2)).graph
    branch = {n.name for n in original if "/mlp/" in n.name and n.op_type != "Constant"}
    layer0 = {n for n in branch if n.startswith("/layers.0/")}
    layer1 = branch - layer0
    assert layer0 and layer1
    assert not layer0 & ran  # gate 0 off: none of its branch ran
    assert layer1 <= ran  # gate 1 on: all of it did


def test_threshold_skips_small_gates_and_compile_reports_the_deviation(tmp_path: Path) -> None:
    feeds = gated_feeds([1, 6], [0.05, 2.0], kind="scalar")  # gate 0 = 0.05: below the threshold
    np.savez(tmp_path / "inputs.npz", **feeds)
    proto = build_gated_model("scalar", num_layers=2)
    options = CompileOptions(zeroing_threshold=0.1, sample_inputs=tmp_path / "inputs.npz")
    result = compile_model(proto, options)
    (out,) = result.verification.outputs
    assert result.verification.passed and out.max_abs > 1e-3  # skipped on purpose, reported
    got = _run(_session(result.model), feeds)
    assert not got[MASK_PREFIX + "layers.0.mlp"] and got[MASK_PREFIX + "layers.1.mlp"]
    with pytest.raises(VerificationError, match="differs by max abs"):
        compile_model(
            proto, CompileOptions(zeroing_threshold=0.1, max_deviation=1e-6, sample_inputs=options.sample_inputs)
        )
    # The threshold is the run-time input layerzero::threshold: at 0 the small gate runs again.
    at_zero = _run(_session(result.model), {**feeds, THRESHOLD_INPUT: np.array(0.0, np.float32)})
    np.testing.assert_allclose(at_zero["y"], _run(_session(proto), feeds)["y"], atol=1e-6, rtol=0)


def test_attention_under_a_token_gate_is_refused_with_a_reason() -> None:
    proto = build_gated_model("token", branch="attention", num_layers=1)
    model = ir.from_proto(proto)
    p, result = _apply(model)
    assert not read_dynamic_paths(model)
    assert [n.op_type for n in model.graph] == [n.op_type for n in ir.from_proto(proto).graph]
    (refused,) = read_refused_branches(model)
    assert refused.path == "layers.0.attention"
    assert "mixes tokens" in refused.reason and "/layers.0/attention/MatMul" in refused.reason
    assert p.refused == [refused]
    assert result.modified  # the reason was recorded in the metadata
    _, again = _apply(model)
    assert not again.modified
    # The same attention under a scalar gate runs or not as a whole: that is fine.
    scalar = ir.from_proto(build_gated_model("scalar", branch="attention", num_layers=1))
    _, done = _apply(scalar)
    assert done.modified and [e.path for e in read_dynamic_paths(scalar)] == ["layers.0.attention"]


def test_constant_gate_and_shared_branch_are_left_alone() -> None:
    text = SCALAR_TEXT.replace(", float logit) =>", ") =>")
    constant = ir.from_onnx_text(
        text.replace('["/block/gate/Relu"] g = Relu(logit)', "g = Constant <value = float {0.5}> ()")
    )
    _, result = _apply(constant)
    assert not result.modified and not read_refused_branches(constant)
    shared = ir.from_onnx_text(
        SCALAR_TEXT.replace("=> (float[T, 4] y)", "=> (float[T, 4] y, float[T, 4] h)")
    )  # f(x) is also a graph output: it cannot be skipped
    _, result = _apply(shared)
    assert not read_dynamic_paths(shared)
    (refused,) = read_refused_branches(shared)
    assert "also read outside" in refused.reason


def test_compiled_gates_show_in_the_engine_report(tmp_path: Path) -> None:
    src = tmp_path / "gated.onnx"
    onnx.save_model(build_gated_model("token", num_layers=2), src)
    result = compile_file(src, tmp_path / "gated.lz")
    assert result.verification.passed and result.verification.needed_atol == 0.0
    manifest = json.loads((tmp_path / "gated.lz" / "manifest.json").read_text())
    assert [(d["path"], d["kind"]) for d in manifest["dynamic"]] == [("layers.0.mlp", "gate"), ("layers.1.mlp", "gate")]
    engine = Engine.load(tmp_path / "gated.lz")
    assert engine.output_names == ["y"]
    shape = [1, 3]
    feeds = gated_feeds(shape, [-np.ones(shape), np.array([1.0, -1.0, 1.0])], kind="token")
    run = engine.run(feeds, masks=True)
    assert run.report.skipped_paths == ["layers.0.mlp"]
    np.testing.assert_array_equal(run.report.masks["layers.1.mlp"], [[True, False, True]])
    np.testing.assert_allclose(run.outputs["y"], _run(_session(onnx.load(src)), feeds)["y"], atol=1e-6, rtol=0)


TOKENWISE_TEXT = f"""
<ir_version: 10, opset_import: ["" : 18]>
tokenwise (float[B, S, 4] x, float[B, S, 1] logit) => (float[B, S, 4] y)
<float[4, 8] w1 = {{{W1}}}, float[8, 4] w2 = {{{W2}}}, float[4] scale = {{1, 2, 3, 4}}, float[4] bias = {{0, 1, 0, 1}},
 int64[1] last = {{-1}}> {{
  g = Sigmoid(logit)
  n = LayerNormalization <axis = -1> (x, scale, bias)
  h1 = MatMul(n, w1)
  p = Softmax <axis = SOFTMAX_AXIS> (h1)
  m1 = ReduceMean <keepdims = 1> (p, last)
  c = Greater(h1, m1)
  h2 = Where(c, h1, p)
  h3 = MatMul(h2, w2)
  h = Add(h3, bias)
  gh = Mul(g, h)
  y = Add(x, gh)
}}
"""


@pytest.mark.parametrize(("axis", "rewritten"), [(-1, True), (2, True), (1, False)])
def test_tokenwise_ops_under_a_token_gate(axis: int, rewritten: bool) -> None:
    text = TOKENWISE_TEXT.replace("SOFTMAX_AXIS", str(axis))
    original = ir.to_proto(ir.from_onnx_text(text))
    model = ir.from_onnx_text(text)
    _apply(model)
    assert bool(read_dynamic_paths(model)) == rewritten
    if not rewritten:
        (refused,) = read_refused_branches(model)
        assert "Softmax" in refused.reason and "other than the last" in refused.reason
        return
    logit = RNG.standard_normal((2, 3, 1)).astype(np.float32)
    logit[0, 1] = -np.inf  # Sigmoid -> exactly 0: that token is skipped
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32), "logit": logit}
    got = _run(_session(model), feeds)
    np.testing.assert_allclose(got["y"], _run(_session(original), feeds)["y"], atol=1e-6, rtol=0)
    (mask,) = [v for k, v in got.items() if k.startswith(MASK_PREFIX)]
    np.testing.assert_array_equal(mask, logit[..., 0] > -np.inf)


def test_refusals_are_match_refusals_recorded_as_before() -> None:
    # The metadata text is the one RefusedBranch wrote ({"path", "reason", "kind"}); a reader reads it back.
    from layerzero.contract import REFUSED_META_KEY
    from layerzero.passes._match import Refusal

    model = ir.from_proto(build_gated_model("token", branch="attention", num_layers=1))
    _apply(model)
    (refused,) = read_refused_branches(model)
    assert isinstance(refused, Refusal) and refused.kind == "gate"
    assert json.loads(model.metadata_props[REFUSED_META_KEY]) == [
        {"path": "layers.0.attention", "reason": refused.reason, "kind": "gate"}
    ]
    older = ir.from_proto(build_gated_model("token", num_layers=1))
    older.metadata_props[REFUSED_META_KEY] = json.dumps([{"path": "a", "reason": "b"}])
    assert read_refused_branches(older) == [Refusal("a", "b", kind="gate")]
