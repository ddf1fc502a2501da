"""A pass that crashes is a compiler bug: one line naming the pass, exit 1, never a traceback (issue 14)."""

from __future__ import annotations

import onnx
import onnx.parser
import pytest

import layerzero.passes.algebraic as algebraic
from layerzero.compile import compile_model
from layerzero.errors import CompilerError
from layerzero.options import CompileOptions

MODEL = """<ir_version: 8, opset_import: ["" : 18]>
g (float[N, 4] x) => (float[N, 4] y) { y = Relu(x) }"""


def test_a_crashing_pass_is_a_compiler_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_args: object, **_kwargs: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(algebraic.SimplifyConcatSplit, "call", boom)
    with pytest.raises(CompilerError, match="internal error in pass SimplifyConcatSplit: ValueError: boom") as info:
        compile_model(onnx.parser.parse_model(MODEL), CompileOptions(verify=False))
    assert info.value.exit_code == 1 and "\n" not in str(info.value)
