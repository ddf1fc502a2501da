"""What the compiler tests of this folder share: the small example transformer (the ``model_path`` fixture of
tests/compiler/conftest.py saves it), the CLI's one-line error check, a model whose verification fails once
``x * 0`` folds, and a pipeline pass made wrong on purpose."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from layerzero.models import TransformerConfig

# 4 blocks: block 1 flagged whole, block 2's rotary encoding flagged.
SMALL = TransformerConfig(num_layers=4, zero_blocks=(1,), zero_rotary=(2,))


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """What the CLI wrote to stderr since the last read: exactly one line (asserted), returned."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def nan_model() -> onnx.ModelProto:
    """1/(x-x) is inf; inf*0 is NaN in the original, 0 once x*0 is folded (assume_finite): verification fails."""
    return onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 18]>
        g (float[N, 4] x) => (float[N, 4] y) <float[4] z = {0.0, 0.0, 0.0, 0.0}> {
            d = Sub(x, x)
            r = Reciprocal(d)
            y = Mul(r, z)
        }"""
    )


def make_pass_wrong(monkeypatch: pytest.MonkeyPatch, op_type: str, wrong_op_type: str) -> None:
    """The pipeline's SimplifyConcatSplit slot (a pass of the same name) turns the first ``op_type`` node into
    ``wrong_op_type`` (wrong on purpose); ``monkeypatch.undo()`` restores the pipeline."""
    from layerzero import pipeline

    class SimplifyConcatSplit(pipeline.SimplifyConcatSplit):  # same name: the pipeline's slot
        def call(self, model: ir.Model) -> ir.passes.PassResult:
            for node in model.graph:
                if node.op_type == op_type:
                    node.op_type = wrong_op_type
                    return ir.passes.PassResult(model, modified=True)
            return super().call(model)

    monkeypatch.setattr(pipeline, "SimplifyConcatSplit", SimplifyConcatSplit)
