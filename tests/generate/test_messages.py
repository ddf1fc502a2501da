"""Messages that must not mislead (issue 12): verification says what it compared with what, by which rule,
and every tolerance it suggests passes when followed; the demo's help describes the demo; a compile whose
node count goes up says why.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import onnx
import pytest

from layerzero.cli import main
from layerzero.models.moe import MoEConfig, build_moe
from layerzero.verify import tolerance_at_least


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("messages") / "moe.onnx"
    onnx.save(build_moe(MoEConfig()), str(path))
    return path


def _out(capsys: pytest.CaptureFixture) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())  # rich wraps lines: compare on words


@pytest.mark.parametrize("value", [0.7934, 0.793, 1e-7, 1.4301e-06, 123456.0, 0.1 + 0.2, 5e-324, 9.999e-5])
def test_tolerance_at_least_rounds_up(value: float) -> None:
    text = tolerance_at_least(value)
    assert float(text) >= value
    assert float(text) <= value * 1.011 or value < 1e-300  # 3 significant digits, rounded up, not inflated
    assert tolerance_at_least(0.0) == "0" and tolerance_at_least(math.inf) == "inf"


def test_threshold_without_bound_is_reported_not_passed(moe: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    args = ["compile", str(moe), "-o", str(tmp_path / "a.lz"), "--threshold", "0.99", "--moe-lowering", "if"]
    assert main(args) == 0  # the `if` lowering pinned: its node count is checked below
    out = _out(capsys)
    assert "passed at atol" not in out and "passed" not in out.split("verification", 1)[1].split()[0]
    assert "verification reported: compiled with --threshold 0.99 vs the reference = the original" in out
    assert "not checked (no --max-deviation)" in out
    # The node count goes up (the skipping form), and compile says why.
    assert re.search(r"nodes +44 → 126", out) and "more nodes: each dynamic block" in out


def test_max_deviation_suggestion_passes_when_followed(moe: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    out_dir = tmp_path / "b.lz"
    assert main(["compile", str(moe), "-o", str(out_dir), "--threshold", "0.99", "--max-deviation", "0.001"]) == 1
    out = _out(capsys)
    assert "--atol" not in out.split("FAILED", 1)[1]  # the bound is --max-deviation, not --atol
    assert "passes when max |compiled - reference| <= --max-deviation 0.001" in out
    suggested = re.findall(r"it would pass with --max-deviation ([0-9.e+-]+)", out)
    assert suggested and len(set(suggested)) == 1 and not out_dir.exists()
    args = ["compile", str(moe), "-o", str(out_dir), "--threshold", "0.99", "--max-deviation", suggested[0]]
    assert main(args) == 0
    assert "verification passed" in _out(capsys)


def test_atol_suggestion_passes_when_followed(moe: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    out_dir = tmp_path / "c.lz"
    # atol = rtol = 0: the If lowering sums the experts in another order, so float rounding differs.
    code = main(["compile", str(moe), "-o", str(out_dir), "--atol", "0", "--rtol", "0"])
    out = _out(capsys)
    if code == 0:
        pytest.skip("the compiled MoE matched bit for bit on this machine: no failing tolerance to follow")
    assert code == 1 and "passes when |compiled - reference| <= atol + rtol * |reference| (--atol 0, --rtol 0)" in out
    suggested = re.findall(r"it would pass with (--atol [0-9.e+-]+ --rtol [0-9.e+-]+)", out)
    assert suggested and len(set(suggested)) == 1
    assert main(["compile", str(moe), "-o", str(out_dir), *suggested[0].split()]) == 0
    assert "verification passed: compiled vs the reference = the original" in _out(capsys)


def test_demo_help_and_comparisons_name_what_they_compare(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = _out(capsys)
    assert "consumed" not in help_text  # the demo has no consumed-form flag
    assert "layers.0.attention.rotary_emb.flag = 0" in help_text
    assert main(["demo", "--layers", "4", "--hidden", "64", "--runs", "1", "--seq", "8"]) == 0
    out = _out(capsys)
    assert "verification passed: compiled vs the reference = the original with its bypassed layers taken out" in out
    assert "what the removed layers contribute (removed on purpose, not a compiler error)" in out
    assert "original (flagged layers still computed) vs compiled (layers removed)" in out
