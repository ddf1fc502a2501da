"""Verification's runners (whole model, chunked) and its comparator: one interface, the same numbers, one rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.chunked import ChunkedRunner, weight_bytes
from layerzero.compile import compile_model
from layerzero.contract import MASK_PREFIX, ROUTER_PREFIX
from layerzero.errors import VerificationError
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions
from layerzero.verify import ChunkedRunners, Comparator, OrtRunner, WholeModelRunners, verification_runners
from tests.compiler.shared import make_pass_wrong


def _parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model('<ir_version: 10, opset_import: ["" : 18]>\n' + text)


def test_whole_model_and_chunked_runners_give_the_same_outputs(tmp_path: Path) -> None:
    config = TransformerConfig(num_layers=3)
    proto = build_transformer(config)
    model = ir.from_proto(proto)
    feeds = example_feeds(config, batch=2, seq=5)
    whole_names, whole = OrtRunner(proto.SerializeToString()).run(feeds)
    # A budget below any one weight: one chunk per top-level node that reads a weight.
    chunk_names, chunks = ChunkedRunner(model, budget_bytes=1).run(feeds)
    saved_names, saved = WholeModelRunners(tmp_path, None, proto).of(model, "m").run(feeds)
    assert whole_names == chunk_names == saved_names == [o.name for o in proto.graph.output]
    for a, b, c in zip(whole, chunks, saved):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(c, a)
    assert (tmp_path / "m.onnx").exists()


def test_verification_runners_are_chunked_above_the_budget_only(tmp_path: Path) -> None:
    proto = build_transformer(TransformerConfig(num_layers=1))
    model = ir.from_proto(proto)
    size = weight_bytes(model)
    chunked = verification_runners(model, size - 1, tmp_path, None, proto, lambda: ir.from_proto(proto))
    whole = verification_runners(model, size, tmp_path, None, proto, lambda: ir.from_proto(proto))
    assert isinstance(chunked, ChunkedRunners) and chunked.budget_bytes == (size - 1) // 2
    assert not chunked.all_input_sets and chunked.bisect_skipped is not None
    assert isinstance(whole, WholeModelRunners) and whole.all_input_sets and whole.bisect_skipped is None


def test_comparator_compares_the_user_outputs_only() -> None:
    comparator = Comparator(atol=1e-4, rtol=1e-3)
    y = np.array([1.0, -2.0, 3.0], np.float32)
    mask = np.array([True, False])
    router = np.array([0.5], np.float32)
    names = ["y", MASK_PREFIX + "p", ROUTER_PREFIX + "p"]
    [close] = comparator.compare(["y"], [y], names, [y + np.float32(5e-5), mask, router])
    assert close.passed and close.max_abs == pytest.approx(5e-5, rel=1e-2)  # float32 steps near 3.0
    [far] = comparator.compare(["y"], [y], names, [y + np.float32(1.0), mask, router])
    assert not far.passed and far.max_abs == pytest.approx(1.0)
    assert comparator.agrees(["y"], [y], names, [y, mask, router])
    assert not comparator.agrees(["y"], [y], names, [y + np.float32(1.0), mask, router])
    with pytest.raises(VerificationError, match=r"^compiled model outputs \['z'\] differ from the original's \['y'\]$"):
        comparator.compare(["y"], [y], ["z"], [y])
    assert not comparator.agrees(["y"], [y], ["z"], [y])


def test_comparator_with_a_threshold_judges_by_max_deviation() -> None:
    y = np.zeros(3, np.float32)
    outputs = Comparator(1e-4, 1e-3).compare(["y"], [y], ["y"], [y + np.float32(0.01)])
    assert not outputs[0].passed
    Comparator(1e-4, 1e-3, zeroing_threshold=0.1, max_deviation=0.02).judge(outputs)
    assert outputs[0].passed
    Comparator(1e-4, 1e-3, zeroing_threshold=0.1, max_deviation=0.001).judge(outputs)
    assert not outputs[0].passed
    Comparator(1e-4, 1e-3, zeroing_threshold=0.1, max_deviation=None).judge(outputs)
    assert outputs[0].passed  # reported, never failed


def _wrong_relu(monkeypatch) -> None:
    """The pipeline's SimplifyConcatSplit slot turns Relu into Abs: wrong on any negative input."""
    make_pass_wrong(monkeypatch, "Relu", "Abs")


_RELU = """g (float[batch, 3] x) => (float[batch, 3] y) <float[3] w = {0.5, -0.25, 1.0}> {
    h = Add(x, w)
    y = Relu(h)
}"""


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_mismatch_is_one_line_with_the_bisection_the_runners_allow(monkeypatch, chunked: bool) -> None:
    _wrong_relu(monkeypatch)
    options = CompileOptions(chunked_verify_bytes=1) if chunked else CompileOptions()
    with pytest.raises(VerificationError) as info:
        compile_model(_parse(_RELU), options)
    message = str(info.value)
    assert message.startswith("verification failed: output 'y' differs by max abs ")
    assert "on the default inputs {'x': [1, 3]}" in message
    if chunked:
        assert "; pass bisection skipped (weights over --chunked-verify-bytes); " in message
        assert [s["label"] for s in info.value.result.input_sets] == ["default", "dynamic dims 1"]
    else:
        assert "; first diverging pass: SimplifyConcatSplit (static iteration 1); " in message
    assert "it would pass with --atol " in message and "\n" not in message
    assert info.value.exit_code == 1
