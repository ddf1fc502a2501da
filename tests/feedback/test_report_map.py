"""The zeroing map: a valid PNG / SVG of sensible size, an HTML page with the heatmap and the table."""

from __future__ import annotations

import json
import runpy
import struct
from pathlib import Path

import numpy as np
import pytest

from layerzero.cli import main
from layerzero.report_map import write_report, zeroing_grid

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"
    return width, height


def test_grid_rows_are_layers_columns_are_paths(moe_case) -> None:
    grid = zeroing_grid(moe_case.doc)
    assert grid.rows == ["layers.0"] and grid.columns == ["0", "1", "2", "3"]
    assert grid.column_label == "moe.experts."
    assert grid.rate[0, 3] == 1.0 and grid.rate[0, 2] == pytest.approx(18 / 21)
    assert grid.impact[0, 3] == 0.0 and grid.impact[0, 2] > 0.01
    assert not grid.static.any()


def test_png(moe_case, tmp_path: Path) -> None:
    out = write_report(moe_case.doc, tmp_path / "map.png")
    width, height = _png_size(out.read_bytes())
    assert 500 <= width <= 4000 and 300 <= height <= 4000
    assert 10_000 < out.stat().st_size < 2_000_000


def test_html_is_self_contained(moe_case, tmp_path: Path) -> None:
    text = write_report(moe_case.doc, tmp_path / "map.html", window=6).read_text()
    assert text.startswith("<!DOCTYPE html>") and "<table>" in text and "</table>" in text
    assert "data:image/png;base64," in text and "http" not in text.replace("http-equiv", "")
    for p in moe_case.doc["paths"]:
        assert f"<td>{p['path']}</td>" in text
    row = text[text.index("<td>layers.0.moe.experts.3</td>") :].split("</tr>")[0]
    assert row.endswith("<td>removes</td>")  # compile --profile --stability-window 6: stable 6 requests, impact 0


def test_svg_and_static_cells(tmp_path: Path, moe_case) -> None:
    doc = json.loads(json.dumps(moe_case.doc))
    doc["paths"].append(
        {
            "path": "layers.1.mlp", "parent": "layers.1.mlp", "kind": "static", "removed_kind": "declared-flag",
            "index": 0, "params": 10, "tokens": {"run": 0, "skipped": 21}, "requests": {"run": 0, "skipped": 6},
            "zeroing_stability": {"tokens": 21, "requests": 6}, "zeroing_impact": {"model": None},
        }
    )  # fmt: skip
    grid = zeroing_grid(doc)
    assert grid.rows == ["layers.0", "layers.1"] and grid.column_label == ""  # no shared prefix any more
    assert grid.columns == ["mlp", "moe.experts.0", "moe.experts.1", "moe.experts.2", "moe.experts.3"]
    assert grid.static[1, 0] and grid.rate[1, 0] == 1.0 and np.isnan(grid.rate[1, 1]) and np.isnan(grid.rate[0, 0])
    svg = write_report(doc, tmp_path / "map.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_cli_report(moe_case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(moe_case.profile), "-o", str(tmp_path / "m.png")]) == 0
    _png_size((tmp_path / "m.png").read_bytes())
    assert main(["report", str(moe_case.profile), "-o", str(tmp_path / "m.html")]) == 0
    capsys.readouterr()
    assert main(["report", str(moe_case.profile), "-o", str(tmp_path / "m.jpg")]) == 2
    assert "written as .png, .svg, .html" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "none.json"), "-o", str(tmp_path / "m.png")]) == 2


def test_docs_picture_script(tmp_path: Path) -> None:
    """scripts/zeroing_map.py (which draws docs/zeroing_map.png) runs end to end."""
    script = runpy.run_path(str(ROOT / "scripts" / "zeroing_map.py"))
    assert script["main"](["--out", str(tmp_path / "map.png"), "--keep", str(tmp_path / "work")]) == 0
    _png_size((tmp_path / "map.png").read_bytes())
    doc = json.loads((tmp_path / "work" / "profile.json").read_text())
    never = [p for p in doc["paths"] if p["path"] in ("layers.0.moe.experts.7", "layers.3.moe.experts.6")]
    assert [p["tokens"]["run"] for p in never] == [0, 0] and all(p["zeroing_impact"]["model"] == 0 for p in never)


def test_html_last_column_is_what_compile_profile_does(moe_case, tmp_path: Path) -> None:
    """The table's verdict is compile --profile's (same rules, same defaults), not just impact < tolerance."""
    from layerzero.options import CompileOptions
    from layerzero.runtime.bundle import sha256_file
    from layerzero.solidify_plan import plan_solidify

    def verdicts(text: str) -> dict[str, str]:
        rows = {}
        for p in moe_case.doc["paths"]:
            row = text[text.index(f"<td>{p['path']}</td>") :].split("</tr>")[0]
            rows[p["path"]] = row.rsplit("<td>", 1)[1].removesuffix("</td>")
        return rows

    # Compile's default window is 100 requests; the profile has 6: compile --profile removes nothing, and the
    # page says so (impact 0 alone does not make a path go).
    default = verdicts(write_report(moe_case.doc, tmp_path / "default.html").read_text())
    assert "removes" not in default.values()
    assert default["layers.0.moe.experts.3"] == "keeps: skipped at most 6 consecutive requests (&lt; 100)"
    sha = sha256_file(moe_case.model)
    for window in (100, len(moe_case.requests)):
        rows = verdicts(write_report(moe_case.doc, tmp_path / f"w{window}.html", window=window).read_text())
        plan = plan_solidify(CompileOptions(profile=moe_case.profile, stability_window=window), sha)
        assert {p for p, v in rows.items() if v == "removes"} == set(plan.subpaths)
    assert set(plan.subpaths) == {"layers.0.moe.experts.3"}
