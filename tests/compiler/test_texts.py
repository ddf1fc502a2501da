"""What the CLI says must be true: the compile summary counts what it removed, --force is suggested only
where it helps, the removed layers' impact reads as what it is, inspect and flag --list give one count."""

from __future__ import annotations

import json
from pathlib import Path

from layerzero.cli import main
from layerzero.flags import flaggable_scopes
from layerzero.loader import load_model
from layerzero.summary import summarize
from tests.compiler.shared import error_line


def test_compile_summary_counts_whole_layers_and_parts(model_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model.lz"
    assert main(["compile", str(model_path), "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    # layers.1 is flagged whole, layers.2's rotary encoding is a part: both are counted, and named below.
    assert "layers 4 total: 1 removed whole, 1 with a part removed; 2 scopes removed (below)" in text
    assert "removed layers.1 " in text and "removed layers.2.attention.rotary_emb" in text
    assert main(["run", str(out), "--input", "input_ids=1,2,3,4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["removed_scopes"] == ["layers.1", "layers.2.attention.rotary_emb"]
    assert report["summary"].startswith("zeroed 1/4 layers and 1 part of a layer (layers.2.attention.rotary_emb), ")


def test_compile_over_a_non_bundle_never_suggests_force(model_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--force"]):
        assert main(["compile", str(model_path), "-o", str(out), *extra]) == 2
        line = error_line(capsys)
        assert "is not a LayerZero bundle" in line and "pass --force" not in line, line
        assert "--force replaces only a bundle LayerZero wrote" in line
    assert (out / "keep.txt").read_text() == "mine"
    file_out = tmp_path / "notes.txt"
    file_out.write_text("mine")
    assert main(["compile", str(model_path), "-o", str(file_out)]) == 2
    assert "pass --force" not in error_line(capsys) and file_out.read_text() == "mine"
    # A bundle LayerZero wrote: --force is what replaces it, and the message says so.
    bundle = tmp_path / "model.lz"
    assert main(["compile", str(model_path), "-o", str(bundle)]) == 0
    capsys.readouterr()
    assert main(["compile", str(model_path), "-o", str(bundle)]) == 2
    assert "--force" in error_line(capsys)
    assert main(["compile", str(model_path), "-o", str(bundle), "--force"]) == 0


def test_removed_layers_impact_reads_as_on_purpose(model_path: Path, tmp_path: Path, capsys) -> None:
    assert main(["compile", str(model_path), "-o", str(tmp_path / "m.lz")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "what the removed layers contribute (removed on purpose, not a compiler error)" in out
    impact = out[out.index("what the removed layers contribute") :]
    assert "logits changes by max abs" in impact
    assert "(relative to the reference; large where it is near 0)" in impact


def test_demo_says_the_deviation_is_the_layers_it_removes(capsys) -> None:
    assert main(["demo", "--layers", "4", "--hidden", "64", "--runs", "1", "--seq", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "what the removed layers contribute (removed on purpose, not a compiler error)" in out
    assert "what the layers the demo removes on purpose contribute, not an error" in out


def test_inspect_and_flag_list_give_one_count(model_path: Path, capsys) -> None:
    model = load_model(model_path)
    summary = summarize(model)
    candidates = flaggable_scopes(load_model(model_path))
    assert candidates
    for c in candidates:
        assert (c.nodes, c.params) == (summary.scope_nodes[c.scope], summary.scope_params.get(c.scope, 0)), c.scope
