"""compile_model / compile_file: numbers in the manifest, verification, idempotence, the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.compile import compile_file, compile_model
from layerzero.errors import InvalidInputError
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions
from layerzero.runtime import Engine
from tests.compiler.shared import make_pass_wrong, nan_model


def test_consumed_flags_match_the_hand_pruned_oracle(tmp_path: Path) -> None:
    config = TransformerConfig(num_layers=4, flag_form="consumed", zero_blocks=(1, 3))
    oracle = TransformerConfig(num_layers=4, flag_form="consumed", omit_blocks=(1, 3))
    src = tmp_path / "m.onnx"
    onnx.save_model(build_transformer(config), src)
    result = compile_file(src, tmp_path / "m.lz")
    assert [r.scope for r in result.removed] == ["layers.1", "layers.3"]
    assert {r.kind for r in result.removed} == {"consumed-flag"}
    oracle_proto = build_transformer(oracle)
    # Same nodes as the oracle; the flag machinery of the two kept blocks (2 Mul + 2 flag-driven ops) aside.
    assert result.after.nodes <= len(oracle_proto.graph.node)
    feeds = example_feeds(config, batch=2, seq=7)
    got = Engine.load(tmp_path / "m.lz").run(feeds).outputs["logits"]
    want = Engine.load(_save(oracle_proto, tmp_path / "oracle.onnx")).run(feeds).outputs["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save_model(model, path)
    return path


def test_compiling_twice_changes_nothing() -> None:
    config = TransformerConfig(num_layers=3, zero_blocks=(0,), disable_rotary_inv_freq=True)
    first = compile_model(build_transformer(config))
    second = compile_model(ir.to_proto(first.model))
    assert second.after.nodes == first.after.nodes
    assert second.after.params == first.after.params
    assert second.removed == []
    assert second.pipeline.iterations == 1


def test_zero_weight_block_is_reported_and_removed() -> None:
    result = compile_model(build_transformer(TransformerConfig(num_layers=3, zero_weight_blocks=(2,), flags=False)))
    assert [(r.scope, r.kind) for r in result.removed] == [("layers.2", "folded")]
    assert result.zeroed_layers == ["layers.2"]
    assert result.before.params - result.after.params == result.removed[0].params


def test_declared_flag_impact_is_measured() -> None:
    result = compile_model(build_transformer(TransformerConfig(num_layers=3, zero_blocks=(1,))))
    v = result.verification
    assert v.passed and v.needed_atol == 0.0
    assert v.impact is not None and v.impact[0].max_abs > 1e-3  # the layer did something in the original


def test_sample_inputs_and_shapes(tmp_path: Path) -> None:
    config = TransformerConfig(num_layers=2, zero_blocks=(1,), flag_form="consumed")
    npz = tmp_path / "calib.npz"
    np.savez(npz, **example_feeds(config, batch=3, seq=5))
    result = compile_model(build_transformer(config), CompileOptions(sample_inputs=npz))
    assert result.verification.inputs == {"input_ids": [3, 5]}
    result = compile_model(build_transformer(config), CompileOptions(shapes={"input_ids": (2, 11)}))
    assert result.verification.inputs == {"input_ids": [2, 11]}
    with pytest.raises(InvalidInputError, match="input_ids"):
        compile_model(build_transformer(config), CompileOptions(shapes={"input_ids": (2, 11, 1)}))


def test_manifest_is_complete(tmp_path: Path) -> None:
    src = _save(build_transformer(TransformerConfig(num_layers=2, zero_rotary=(0, 1))), tmp_path / "m.onnx")
    compile_file(src, tmp_path / "m.lz")
    manifest = json.loads((tmp_path / "m.lz" / "manifest.json").read_text())
    assert manifest["format"] == "layerzero-bundle"
    assert manifest["options"]["assume_finite"] is True
    assert manifest["layers"]["zeroed"] == []
    assert [r["scope"] for r in manifest["removed"]] == [
        "layers.0.attention.rotary_emb",
        "layers.1.attention.rotary_emb",
        "rotary_emb",  # the cos/sin tables die with their last user
    ]
    model = onnx.load(tmp_path / "m.lz" / "model.onnx")
    ops = {n.op_type for n in model.graph.node}
    assert "Neg" not in ops


def test_chunked_verification_matches_whole_model_verification(tmp_path: Path) -> None:
    config = TransformerConfig(num_layers=4, zero_blocks=(1,), zero_rotary=(2,))
    src = _save(build_transformer(config), tmp_path / "m.onnx")
    whole = compile_model(src)
    chunked = compile_model(src, CompileOptions(chunked_verify_bytes=64 << 10))  # 32 KiB chunks
    assert chunked.verification.passed
    assert chunked.verification.impact[0].max_abs == pytest.approx(whole.verification.impact[0].max_abs, rel=1e-4)
    assert chunked.after.nodes == whole.after.nodes


def test_chunked_verification_still_catches_a_mismatch(tmp_path: Path) -> None:
    from layerzero.errors import VerificationError

    with pytest.raises(VerificationError):
        compile_model(_save(nan_model(), tmp_path / "nan.onnx"), CompileOptions(chunked_verify_bytes=1))


# ------------------------------------------------------------------------------ verification that cannot be fooled


def _parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model('<ir_version: 10, opset_import: ["" : 18]>\n' + text)


def test_rank_0_bool_input_gets_a_0d_array() -> None:
    # issue 14 cause 7: a rank-0 input (here the If condition) must be fed as a 0-d array, not a numpy scalar.
    from layerzero.verify import make_inputs

    model = _parse(
        """g (bool c, float[N, 3] x) => (float[N, 3] y) <float[3] z = {0.0, 0.0, 0.0}> {
            m = Mul(x, z)
            y = If(c) <then_branch = t () => (float[N, 3] a) { a = Relu(m) },
                       else_branch = e () => (float[N, 3] b) { b = Neg(x) }>
        }"""
    )
    feeds = make_inputs(model)
    assert isinstance(feeds["c"], np.ndarray) and feeds["c"].shape == () and feeds["c"].dtype == np.bool_
    assert compile_model(model).verification.passed


def test_input_sets_cover_dims_at_1_larger_dims_and_comparison_thresholds() -> None:
    from layerzero.verify import input_sets

    model = _parse(
        """g (float[batch, S, 3] x) => (float[batch, S, 3] y) <float t = {3.5}, float[3] one = {1.0, 1.0, 1.0}> {
            c = Greater(x, t)
            y = Where(c, x, one)
        }"""
    )
    sets = input_sets(model, seed=0)
    shapes = {s.label: s.shapes()["x"] for s in sets}
    assert shapes["default"] == [1, 8, 3]
    assert shapes["dynamic dims 1"] == [1, 1, 3]
    assert shapes["dynamic dims larger"] == [3, 6, 3]  # larger and all different
    around = next(s for s in sets if s.label.startswith("values around"))
    x = around.feeds["x"]
    assert (x > 3.5).any() and (x < 3.5).any() and (x == 3.5).any()
    result = compile_model(model)
    assert [s["label"] for s in result.verification.input_sets] == [s.label for s in sets]


def test_a_wrong_rewrite_the_default_inputs_miss_is_caught_and_its_pass_named(monkeypatch) -> None:
    # A pass that turns ReduceSum over the batch into ReduceMax: equal at batch 1 (the default inputs, all
    # the old verification ran), wrong at any larger batch.
    from layerzero.errors import VerificationError

    model = _parse(
        """g (float[batch, 3] x) => (float[1, 3] y) <int64[1] axis = {0}> {
            y = ReduceSum <keepdims = 1> (x, axis)
        }"""
    )
    make_pass_wrong(monkeypatch, "ReduceSum", "ReduceMax")
    with pytest.raises(VerificationError) as info:
        compile_model(model)
    message = str(info.value)
    assert "dynamic dims larger inputs {'x': [3, 3]}" in message
    assert "first diverging pass: SimplifyConcatSplit (static iteration 1)" in message
    assert "\n" not in message
    monkeypatch.undo()
    assert compile_model(model).verification.passed


def test_a_compiled_model_onnxruntime_cannot_run_names_the_pass(monkeypatch) -> None:
    # Without the round-trip guard, the gated-branch rewrite makes a model ORT fails on ("Missing Input",
    # issue 14 cause 6): that is the compiler's fault (VerificationError, exit 1), never the sample inputs'.
    from layerzero import pipeline
    from layerzero.errors import VerificationError
    from layerzero.passes import gated_branches

    monkeypatch.setattr(gated_branches, "read_round_trip_sources", lambda node: False)
    monkeypatch.setattr(pipeline, "sidestep_round_trips", lambda model: False)  # the pipeline's own guard too
    model = _parse(
        """g (float[N, 4] xi, float[1] gi) => (float[N, 4] y) {
            xd = Cast <to = 11> (xi)
            x = Cast <to = 1> (xd)
            h = Relu(x)
            m = Mul(gi, h)
            y = Add(x, m)
        }"""
    )
    pattern = r"fails in onnxruntime.*first diverging pass: SkipGatedBranches"
    with pytest.raises(VerificationError, match=pattern) as info:
        compile_model(model)
    assert info.value.exit_code == 1
    monkeypatch.undo()
    assert compile_model(model).verification.passed  # with the guard


def test_compile_model_leaves_the_callers_proto_as_it_was() -> None:
    # The IR shares a ModelProto's tensors: a renamed value renamed the caller's initializer (fuzz seed 534278).
    import onnx

    from layerzero.compile import compile_model
    from layerzero.models import TransformerConfig, build_transformer
    from layerzero.options import CompileOptions

    model = build_transformer(TransformerConfig(num_layers=2, zero_blocks=(1,)))
    before = model.SerializeToString()
    compile_model(model, CompileOptions(verify=False))
    assert model.SerializeToString() == before
    assert isinstance(model, onnx.ModelProto)
