"""The CLI end to end: good paths, and bad input giving one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from layerzero.cli import main
from layerzero.models import build_transformer
from tests.compiler.shared import SMALL, error_line, nan_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_compile_then_run(model_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model.lz"
    assert main(["compile", str(model_path), "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers"] == {"total": 4, "zeroed": ["layers.1"]}
    assert {r["scope"] for r in manifest["removed"]} == {"layers.1", "layers.2.attention.rotary_emb"}
    assert manifest["verification"]["passed"] is True
    assert manifest["source"]["sha256"] == _sha(model_path)
    assert manifest["stats"]["nodes_after"] < manifest["stats"]["nodes_before"]
    capsys.readouterr()
    assert main(["run", str(out), "--input", "input_ids=1,2,3,4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["outputs"]["logits"]["shape"] == [1, 4, SMALL.vocab_size]
    assert doc["report"]["total_layers"] == 4
    assert doc["report"]["zeroed_layers"] == 1
    assert 0 < doc["report"]["zeroed_params_ratio"] < 0.5


def test_compile_refuses_existing_output(model_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["compile", str(model_path), "-o", str(out)]) == 2
    assert "exists and is a directory that is not a LayerZero bundle" in error_line(capsys)
    assert (out / "keep.txt").read_text() == "mine"


def test_compile_refuses_to_overwrite_its_input(model_path: Path, capsys) -> None:
    before = _sha(model_path)
    assert main(["compile", str(model_path), "-o", str(model_path), "--force"]) == 2
    assert "overwrite the input" in error_line(capsys)
    assert _sha(model_path) == before


def _bad_input_case(tmp_path: Path, case: str) -> tuple[Path, str]:
    path = tmp_path / "bad.onnx"
    if case == "truncated":
        data = build_transformer(SMALL).SerializeToString()
        path.write_bytes(data[: len(data) // 3])
        return path, "not a valid ONNX model"
    if case == "not-onnx":
        path.write_text("this is a text file, not a model\n" * 20)
        return path, "ONNX"
    if case == "unknown-op":
        model = onnx.parser.parse_model(
            """<ir_version: 10, opset_import: ["" : 18]>
            g (float[2] x) => (float[2] y) { y = FrobnicateZeros(x) }"""
        )
        path.write_bytes(model.SerializeToString())
        return path, "FrobnicateZeros"
    if case == "missing-external-data":
        model = build_transformer(SMALL)
        onnx.save_model(model, path, save_as_external_data=True, location="bad.onnx.data", size_threshold=0)
        (tmp_path / "bad.onnx.data").unlink()
        return path, "bad.onnx.data"
    if case == "missing-file":
        return tmp_path / "nowhere.onnx", "no such file"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["truncated", "not-onnx", "unknown-op", "missing-external-data", "missing-file"])
def test_bad_model_is_one_line_exit_2_nothing_written(tmp_path: Path, capsys, case: str) -> None:
    path, expected = _bad_input_case(tmp_path, case)
    before = _sha(path) if path.exists() else None
    out = tmp_path / "out.lz"
    assert main(["compile", str(path), "-o", str(out)]) == 2
    line = error_line(capsys)
    assert expected in line, line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".", "out"))) == []
    if before is not None:
        assert _sha(path) == before


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("input_ids=1.5,2.5", "input_ids"),  # wrong dtype
        ("wrong_name=1,2", "wrong_name"),  # unknown input
    ],
)
def test_run_bad_feed(model_path: Path, capsys, item: str, expected: str) -> None:
    assert main(["run", str(model_path), "--input", item]) == 2
    assert expected in error_line(capsys)


def test_run_wrong_rank(model_path: Path, tmp_path: Path, capsys) -> None:
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, input_ids=np.zeros((1, 2, 3), dtype=np.int64))
    assert main(["run", str(model_path), "--inputs", str(feeds)]) == 2
    line = error_line(capsys)
    assert "input_ids" in line and "rank" in line


def test_verification_failure_exits_1_and_writes_nothing(tmp_path: Path, capsys) -> None:
    path = tmp_path / "nan.onnx"
    onnx.save_model(nan_model(), path)
    out = tmp_path / "nan.lz"
    assert main(["compile", str(path), "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert "verification failed" in captured.err
    assert "FAILED" in captured.out
    assert not out.exists()
    # Without the finite assumption the model compiles and verifies.
    assert main(["compile", str(path), "-o", str(out), "--no-assume-finite"]) == 0
    assert (out / "manifest.json").exists()


def test_inspect_lists_flags_and_layers(model_path: Path, capsys) -> None:
    assert main(["inspect", str(model_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layers"] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    zero = {f["name"] for f in doc["flags"] if f["value"] == 0}
    assert zero == {"layers.1.flag", "layers.2.attention.rotary_emb.flag"}
    assert doc["scope_params"]["layers.1"] > 0


def test_console_script_demo_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "layerzero", "demo", "--layers", "4", "--hidden", "64", "--runs", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "verification  passed" in proc.stdout
    assert "p50 latency" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # the demo leaves nothing behind without --workdir
