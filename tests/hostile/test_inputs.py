"""Hostile documents and inputs: profiles (report), group specs, run --input, scalar bool inputs."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from layerzero.errors import InvalidInputError
from layerzero.groups import load_group_spec, parse_group_spec

PATH = {
    "path": "layers.0.mlp",
    "kind": "gated",
    "tokens": {"run": 3, "skipped": 1},
    "requests": {"run": 1, "skipped": 1},
    "zeroing_stability": {"requests": 1, "tokens": 1},
    "zeroing_impact": {"block": 0.1, "model": 0.001},
    "params": 10,
}
PROFILE = {"format": "layerzero-profile", "version": 1, "paths": [PATH],
           "traffic": {"requests": 2, "tokens": 4, "data": "calib.npz"}, "impact": {"samples": 1}}  # fmt: skip


def _write(tmp_path: Path, doc: object, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_report_escapes_every_profile_field(tmp_path: Path, helpers: SimpleNamespace) -> None:
    pytest.importorskip("matplotlib")
    script = "<script>alert(1)</script>"
    doc = copy.deepcopy(PROFILE)
    doc["traffic"] = {"requests": script, "tokens": script, "data": script}
    doc["format_note"] = script
    doc["version"] = 1
    doc["source"] = {"sha256": script}
    doc["bundle"] = {"path": script}
    doc["paths"][0]["path"] = f"layers.0.{script}"
    doc["paths"][0]["kind"] = script
    out = tmp_path / "map.html"
    result = helpers.run_cli("report", _write(tmp_path, doc), "-o", out)
    assert result.code == 0, result.err
    page = out.read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.pop("tokens"),
        lambda p: p["tokens"].pop("skipped"),
        lambda p: p.update(tokens={"run": "3", "skipped": 1}),
        lambda p: p.update(zeroing_stability=None),
        lambda p: p.update(params=-1),
        lambda p: p.pop("path"),
        lambda p: p.update(kind=7),
        lambda p: p.update(zeroing_impact=[1]),
    ],
)
def test_incomplete_path_records_exit_2(mutate, tmp_path: Path, helpers: SimpleNamespace) -> None:
    doc = copy.deepcopy(PROFILE)
    mutate(doc["paths"][0])
    for suffix in ("png", "html"):
        helpers.one_line(helpers.run_cli("report", _write(tmp_path, doc), "-o", tmp_path / f"m.{suffix}"), "path")
    assert not (tmp_path / "m.png").exists() and not (tmp_path / "m.html").exists()


@pytest.mark.parametrize("doc", [[1, 2], "x", {"format": "layerzero-profile", "version": 1, "paths": {"a": 1}},
                                 {"format": "layerzero-profile", "version": 1, "paths": [1]}])  # fmt: skip
def test_malformed_profiles_exit_2(doc: object, tmp_path: Path, helpers: SimpleNamespace) -> None:
    helpers.one_line(helpers.run_cli("report", _write(tmp_path, doc), "-o", tmp_path / "m.png"))


def test_math_text_in_path_names_is_drawn_literally(tmp_path: Path, helpers: SimpleNamespace) -> None:
    pytest.importorskip("matplotlib")
    doc = copy.deepcopy(PROFILE)
    doc["paths"][0]["path"] = r"layers.0.$\frac{1}{0$"
    doc["traffic"]["requests"] = r"$\undefined$"
    result = helpers.run_cli("report", _write(tmp_path, doc), "-o", tmp_path / "m.png")
    assert result.code == 0, result.err


# ------------------------------------------------------------------------------------------ group specs


def test_100k_groups_parse_in_seconds() -> None:
    n = 100_000
    data = {"router": {"output": "r"}, "groups": [{"name": f"g{i}", "scopes": [f"layers.{i}"]} for i in range(n)]}
    started = time.perf_counter()
    spec = parse_group_spec(data)
    assert len(spec.groups) == n
    assert time.perf_counter() - started < 30  # quadratic took > 300 s; linear is ~1 s on an idle core
    data["groups"].append({"name": "g5", "scopes": ["layers.1"]})
    with pytest.raises(InvalidInputError, match="'g5' is used twice"):
        parse_group_spec(data)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n"),
        ("deep-map.yaml", "".join("  " * i + "a:\n" for i in range(5000))),
        ("deep.json", "[" * 20000 + "]" * 20000),
        ("alias.yaml", "a: &a [1]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\ngroups: *c\nrouter: {output: r}\n"),
        ("tab.yaml", "groups:\n\t- x\n"),
    ],
)
def test_hostile_group_specs_are_one_line_errors(name: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InvalidInputError) as info:
        load_group_spec(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_deep_group_spec_through_compile(tiny: SimpleNamespace, tmp_path: Path, helpers: SimpleNamespace) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("groups: " + "[" * 20000 + "]" * 20000 + "\n")
    helpers.one_line(helpers.run_cli("compile", tiny.source, "-o", tmp_path / "g.lz", "--groups", spec), "nested")
    assert not (tmp_path / "g.lz").exists()


# ------------------------------------------------------------------------------------------ run inputs


def _bool_model(path: Path) -> Path:
    graph = oh.make_graph(
        [oh.make_node("Neg", ["x"], ["y"]), oh.make_node("Where", ["flag", "x", "y"], ["out"])],
        "g",
        [oh.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
         oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [oh.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2])],
    )  # fmt: skip
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), str(path))
    return path


def test_scalar_bool_input_compiles_and_runs_from_text(tmp_path: Path, helpers: SimpleNamespace) -> None:
    model = _bool_model(tmp_path / "bool.onnx")
    bundle = tmp_path / "bool.lz"
    result = helpers.run_cli("compile", model, "-o", bundle)
    assert result.code == 0, result.err
    out = tmp_path / "out.npz"
    for flag, want in (("1", [0.5, 1.5]), ("0", [-0.5, -1.5])):
        result = helpers.run_cli("run", bundle, "--input", f"flag={flag}", "--input", "x=0.5,1.5", "--save", out)
        assert result.code == 0, result.err
        got = np.load(out)["out"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    helpers.one_line(helpers.run_cli("run", bundle, "--input", "flag=2", "--input", "x=0.5,1.5"), "flag")
