"""The MoE speed column's machinery (tests/corpus/corpus_speed.py, scripts/coverage_table.py ``--speed``).

The measurement itself is not a test (CI time: an export at hidden 512 per family); these check what it
measures (each family's speed size), that a result keeps what it recorded (lowering, load) through the cache,
and that the table says what the result says (slower rows marked, old results without the new fields shown).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

pytest.importorskip("transformers", reason="the speed sizes come from transformers' default configs")

import corpus_speed  # noqa: E402
from corpus_families import FAMILIES  # noqa: E402

MOE = [f for f in FAMILIES.values() if f.moe]


def _coverage_table():
    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("coverage_table")


@pytest.mark.parametrize("family", MOE, ids=lambda f: f.name)
def test_speed_family_is_the_documented_size(family) -> None:
    default_experts, default_k, separate = corpus_speed._default_experts(family)
    sized = corpus_speed.speed_family(family)
    kw = sized.kwargs
    assert sized.name == f"{family.name}@speed"
    assert kw["hidden_size"] == 512 and kw["num_hidden_layers"] == 2 and kw["vocab_size"] == 1024
    experts = {kw[k] for k in corpus_speed._EXPERT_KEYS if k in kw}
    top_k = {kw[k] for k in corpus_speed._TOP_K_KEYS if k in kw}
    assert experts == {min(default_experts, 32)}, experts
    assert top_k == {min(default_k, 8, min(default_experts, 32))}, top_k
    mlp = kw["moe_intermediate_size"] if separate else kw["intermediate_size"]
    assert mlp == (1024 if default_experts <= 16 else 256)


def test_speed_result_round_trips_through_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LAYERZERO_CORPUS_CACHE", str(tmp_path))
    result = corpus_speed.SpeedResult(
        "jetmoe", "dynamo", config="8 experts, top-2, expert MLP 1024", moe_blocks=2, export_ms=5.9,
        compiled_ms=5.1, speedup=1.16, max_abs=0.0, lowering="if", load="1.5 -> 2.25",
    )
    path = corpus_speed.write_speed(result)
    assert path.parent == corpus_speed.speed_dir() and path.name == "jetmoe__dynamo.json"
    read = corpus_speed.read_speed()
    assert list(read) == ["jetmoe/dynamo"]
    assert read["jetmoe/dynamo"]["lowering"] == "if" and read["jetmoe/dynamo"]["load"] == "1.5 -> 2.25"
    assert read["jetmoe/dynamo"]["speedup"] == 1.16


def test_speed_table_rows() -> None:
    table = _coverage_table()
    base = {"config": "8 experts, top-2, expert MLP 1024", "moe_blocks": 2, "max_abs": 0.0}
    speed = {
        "mixtral/dynamo": {**base, "export_ms": 8.0, "compiled_ms": 4.0, "speedup": 2.0, "lowering": "if",
                           "load": "1.0 -> 2.0"},
        "jetmoe/dynamo": {**base, "export_ms": 5.94, "compiled_ms": 6.34, "speedup": 0.94},  # an old result
        "llama4/dynamo": {"config": "", "export_error": "ConversionError: complex"},
    }
    lines = table._speed_notes(speed)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert "| 2.00× | 2/2 | 0.0e+00 | if | 1.0 → 2.0 |" in rows["mixtral"]
    assert "0.94× **slower**" in rows["jetmoe"] and rows["jetmoe"].endswith("| · | · |")
    assert "export ✗" in rows["llama4"] and rows["llama4"].endswith("| – | – |")
    assert all(line.count("|") == 11 for line in rows.values()), rows  # 10 columns
    summary = next(line for line in lines if line.startswith("Compiled p50 above the export's"))
    assert "jetmoe/dynamo (6.34 vs 5.94 ms)" in summary and "mixtral/torchscript" in summary
    assert "Below the 1.15× target: jetmoe/dynamo (0.94×)." in summary
    assert lines[-1].startswith("- jetmoe / dynamo is the closest row")  # the row's note, since the row is there
    alone = table._speed_notes({"mixtral/dynamo": speed["mixtral/dynamo"]})
    assert not any(line.startswith("- jetmoe") for line in alone)
    assert table._speed_cell(speed["mixtral/dynamo"]) == "2.00×"
