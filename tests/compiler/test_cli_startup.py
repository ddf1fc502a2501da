"""``layerzero --help`` and ``layerzero inspect`` start without the heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import onnx.helper as oh

HEAVY = ("onnx", "onnx_ir", "onnxruntime", "torch", "numpy", "layerzero.compile")


def _modules_after(code: str) -> list[str]:
    probe = (
        "import contextlib, io, json, sys\n"
        f"{code}\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_no_verb_and_nothing_heavy() -> None:
    code = (
        "from layerzero.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
        "assert 'triton-export' in text.getvalue() and 'inspect' in text.getvalue()\n"
        "assert not any(m.startswith('layerzero.cli.') for m in sys.modules if m != 'layerzero.cli.__main__')"
    )
    assert _modules_after(code) == []


def test_inspect_imports_neither_onnxruntime_nor_torch(tmp_path: Path) -> None:
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"], name="/layers.0/Relu")],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    code = (
        "from layerzero.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['inspect', {str(path)!r}]) == 0"
    )
    loaded = _modules_after(code)
    assert "onnxruntime" not in loaded and "torch" not in loaded and "layerzero.compile" not in loaded
    assert "onnx_ir" in loaded  # it did inspect the model
