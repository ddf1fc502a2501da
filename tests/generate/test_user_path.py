"""The user path of an exported LLM, as a new user takes it (issue 20): export, then the README's "Use" verbs.

One tiny Llama (random weights, ``save_pretrained``; layer 1's MLP output projection all zero, so that the
compiler removes a path and the profile has something to count and draw) is exported once per module with the
KV cache (dynamo exporter). The oracle is transformers' own forward on the same folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))  # corpus_export, corpus_families

from layerzero.cli import main  # noqa: E402
from layerzero.errors import InvalidInputError  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from tests.tiny_llama import greedy_llama_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 128, 2, 2, 16
README = Path(__file__).resolve().parents[2] / "README.md"


def _config() -> transformers.LlamaConfig:
    return greedy_llama_config(LAYERS, VOCAB)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("user-path")


@pytest.fixture(scope="module")
def llama_dir(tmp: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.zero_()
    path = tmp / "tiny-llama"
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps({"model": "word-level", "of": "tiny-llama"}))
    return path


# exported, bundle: tests/generate/conftest.py


def _hf_logits(model_dir: Path, ids: list[list[int]], mask: list[list[int]] | None = None) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    kwargs = {}
    if mask is not None:
        m = torch.tensor(mask)
        kwargs = {"attention_mask": m, "position_ids": (m.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


def _error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------------- 1. export writes over nothing


def test_export_never_writes_over_a_file_it_did_not_write(
    llama_dir: Path, exported: Path, tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp / "victims"
    folder.mkdir()
    victim = folder / "victim.onnx"
    victim.write_bytes(b"the user's own file")
    capsys.readouterr()
    for force in ([], ["--force"]):  # --force replaces only a model layerzero export wrote
        assert main(["export", str(llama_dir), "-o", str(victim), *force]) == 2
        assert "victim.onnx" in _error(capsys)
        assert victim.read_bytes() == b"the user's own file"

    # The files it copies beside the model: a different one there is refused up front, --force or not.
    for name in ("tokenizer.json", "generation_config.json"):
        beside = tmp / f"beside-{name}"
        beside.mkdir()
        (beside / name).write_text("the user's own")
        for force in ([], ["--force"]):
            assert main(["export", str(llama_dir), "-o", str(beside / "m.onnx"), *force]) == 2
            err = _error(capsys)
            assert name in err and "differs" in err
            assert (beside / name).read_text() == "the user's own"
            assert sorted(p.name for p in beside.iterdir()) == [name]  # refused before any work

    # <name>.data: the external weights file of the export, never a user's file of that name.
    data = tmp / "data"
    data.mkdir()
    (data / "m.onnx.data").write_bytes(b"user data")
    assert main(["export", str(llama_dir), "-o", str(data / "m.onnx")]) == 2
    assert "m.onnx.data" in _error(capsys)
    assert (data / "m.onnx.data").read_bytes() == b"user data" and not (data / "m.onnx").exists()

    # Its own export: replaced with --force only; the copied files, identical, are left as they are.
    assert main(["export", str(llama_dir), "-o", str(exported)]) == 2
    assert "--force" in _error(capsys)
    tokenizer = exported.parent / "tokenizer.json"
    before = (tokenizer.stat().st_mtime_ns, tokenizer.stat().st_ino)
    assert main(["export", str(llama_dir), "-o", str(exported), "--force", "--exporter", "torchscript"]) == 0
    assert (tokenizer.stat().st_mtime_ns, tokenizer.stat().st_ino) == before
    meta = {p.key: p.value for p in onnx.load(str(exported), load_external_data=False).metadata_props}
    assert json.loads(meta["layerzero.generate"])["exporter"] == "torchscript"
    assert main(["export", str(llama_dir), "-o", str(exported), "--force"]) == 0  # back to the module's dynamo one


def test_second_model_into_the_same_folder_keeps_the_first_ones_files(
    llama_dir: Path, exported: Path, tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp / "other-llama"
    transformers.LlamaForCausalLM(_config()).save_pretrained(other)
    (other / "tokenizer.json").write_text(json.dumps({"model": "another tokenizer"}))
    first = (exported.parent / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["export", str(other), "-o", str(exported.parent / "other.onnx")]) == 2
    assert "tokenizer.json" in _error(capsys)
    assert (exported.parent / "tokenizer.json").read_bytes() == first
    assert not (exported.parent / "other.onnx").exists()


# ------------------------------------------------------------------------------- 2. --no-cache, both exporters


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_no_cache_export_computes_transformers_logits(
    llama_dir: Path, tmp: Path, exporter: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp / f"nocache-{exporter}" / "llama1.onnx"
    assert main(["export", str(llama_dir), "-o", str(out), "--no-cache", "--exporter", exporter]) == 0
    graph = onnx.load(str(out), load_external_data=False).graph
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [v.name for v in graph.output] == ["logits"]
    ids = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11]]
    engine = Engine.load(out)
    got = engine.run(engine.first_step_feeds({"input_ids": np.array(ids)})).outputs["logits"]
    np.testing.assert_allclose(got, _hf_logits(llama_dir, ids), rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert main(["run", str(out), "--input", "input_ids=5,17,99", "--json"]) == 0
    logits = np.array(json.loads(capsys.readouterr().out)["outputs"]["logits"]["values"])
    np.testing.assert_allclose(logits, _hf_logits(llama_dir, [[5, 17, 99]]), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ 3. run / profile fill a first step's inputs


def test_run_takes_input_ids_alone(llama_dir: Path, bundle: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["run", str(bundle), "--input", "input_ids=1,2,3", "--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    np.testing.assert_allclose(
        np.array(outputs["logits"]["values"]), _hf_logits(llama_dir, [[1, 2, 3]]), rtol=1e-4, atol=1e-4
    )
    assert outputs["present.0.key"]["shape"] == [1, KV_HEADS, 3, HEAD_DIM]
    # A given input is used as is: a left-padded mask (positions then count the kept tokens, as generate does).
    assert main(["run", str(bundle), "--input", "input_ids=0,2,3", "--input", "attention_mask=0,1,1", "--json"]) == 0
    logits = np.array(json.loads(capsys.readouterr().out)["outputs"]["logits"]["values"])
    want = _hf_logits(llama_dir, [[0, 2, 3]], mask=[[0, 1, 1]])
    np.testing.assert_allclose(logits[:, 1:], want[:, 1:], rtol=1e-4, atol=1e-4)


def test_first_step_feeds_continue_a_given_past(llama_dir: Path, bundle: Path) -> None:
    engine = Engine.load(bundle)
    first = engine.run(engine.first_step_feeds({"input_ids": [5, 17, 99]})).outputs
    past = {f"past_key_values.{i}.{kv}": first[f"present.{i}.{kv}"] for i in range(LAYERS) for kv in ("key", "value")}
    feeds = engine.first_step_feeds({"input_ids": np.array([[3]]), **past})
    assert feeds["attention_mask"].shape == (1, 4) and feeds["position_ids"].tolist() == [[3]]
    step = engine.run(feeds).outputs["logits"]
    whole = _hf_logits(llama_dir, [[5, 17, 99, 3]])
    np.testing.assert_allclose(step[:, -1], whole[:, -1], rtol=1e-4, atol=1e-4)


def test_profile_takes_input_ids_alone(bundle: Path, tmp: Path) -> None:
    rng = np.random.default_rng(0)
    for name, shape in (("calib3.npz", (4, 1, 6)), ("calib2.npz", (4, 6))):  # [R, 1, T] and [R, T]
        data = tmp / name
        np.savez(data, input_ids=rng.integers(0, VOCAB, shape))
        out = tmp / f"{name}.profile.json"
        assert main(["profile", str(bundle), "--data", str(data), "-o", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["traffic"]["requests"] == 4 and doc["traffic"]["tokens"] == 24
        assert "model.layers.1.mlp" in {p["path"] for p in doc["paths"]}


# ---------------------------------------------------------------------------- 4. token ids inside the vocabulary


def test_run_refuses_token_ids_outside_the_vocabulary(
    bundle: Path, exported: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    for bad in ("-1", str(VOCAB)):
        assert main(["run", str(bundle), "--input", f"input_ids=1,{bad},3"]) == 2
        err = _error(capsys)
        assert "'input_ids'" in err and f"token id {bad} " in err and f"[0, {VOCAB})" in err
    engine = Engine.load(exported)  # the plain export too, through Engine.run
    assert engine.vocab_size == VOCAB
    with pytest.raises(InvalidInputError, match=r"token id -1 is outside the vocabulary \[0, 128\)"):
        engine.run(engine.first_step_feeds({"input_ids": [[4, -1]]}))
    assert engine.run(engine.first_step_feeds({"input_ids": [[0, VOCAB - 1]]})).outputs["logits"].shape == (1, 2, VOCAB)


# ------------------------------------------------------------------------------ 5. a wrong shape is one line


def test_wrong_shapes_are_named_before_onnxruntime_runs(bundle: Path, capsys: pytest.CaptureFixture) -> None:
    engine = Engine.load(bundle)
    feeds = engine.first_step_feeds({"input_ids": [[1, 2, 3]]})
    cases = {
        "position_ids": (np.zeros((2, 3), np.int64), r"'position_ids': shape \[2, 3\], expected \[1, 3\]"),
        "past_key_values.1.value": (
            np.zeros((2, KV_HEADS, 0, HEAD_DIM), np.float32),
            r"'past_key_values.1.value': shape \[2, 2, 0, 16\], expected \[1, 2, 0, 16\]",
        ),
        "attention_mask": (np.ones((1, 5), np.int64), r"'attention_mask': shape \[1, 5\], expected \[1, 3\]"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(InvalidInputError, match=message):
            engine.run({**feeds, name: value})
    capsys.readouterr()
    assert main(["run", str(bundle), "--input", "input_ids=1,2,3", "--input", "attention_mask=1,1"]) == 2
    err = _error(capsys)
    assert "'attention_mask'" in err and "[1, 2]" in err and "expected [1, 3]" in err and "onnxruntime" not in err


# ----------------------------------------------------------------------------------- 6. profile names it once


def test_profile_data_error_names_the_file_once(bundle: Path, exported: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["profile", str(bundle), "--data", str(exported), "-o", str(bundle.parent / "p.json")]) == 2
    err = _error(capsys)
    assert err.count(str(exported)) == 1, err


# ------------------------------------------------------------------- 7. the README's "Use" commands, as written


def _use_commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Use", 1)[1].split("```", 1)[0]
    commands = []
    for line in section.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("layerzero "):
            commands.append(shlex.split(line)[1:])
    return commands


def test_readme_use_commands_run_on_an_export(
    exported: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Each ``layerzero`` line of the README's "Use" block, as written, in a folder holding what it names: the
    export as ``model.onnx`` and calibration text (``input_ids`` only) as ``calib.npz``. ``demo`` has its own
    tests (tests/compiler/test_cli.py)."""
    commands = [c for c in _use_commands() if c[0] != "demo"]
    assert [c[0] for c in commands] == ["inspect", "compile", "run", "profile", "compile", "report"]
    work = tmp / "readme"
    work.mkdir()
    os.symlink(exported, work / "model.onnx")
    np.savez(work / "calib.npz", input_ids=np.random.default_rng(1).integers(0, VOCAB, (3, 1, 5)))
    monkeypatch.chdir(work)
    for argv in commands:
        if argv[0] == "report":
            pytest.importorskip("matplotlib", reason="layerzero report draws with matplotlib ('.[report]')")
        capsys.readouterr()
        assert main(argv) == 0, f"layerzero {shlex.join(argv)}: {capsys.readouterr().err}"
    for name in ("model.lz", "profile.json", "solid.lz", "map.png"):
        assert (work / name).exists(), name
    profile = json.loads((work / "profile.json").read_text())
    assert profile["traffic"]["tokens"] == 15
    assert re.search(r"model\.layers\.1\.mlp", json.dumps(profile["paths"]))


# ------------------------------------------------------------ the same on the corpus's Qwen2 and Qwen3-MoE


def _corpus_family(name: str):  # the export corpus's family table (tests/corpus/corpus_families.py)
    import dataclasses

    from corpus_families import FAMILIES

    family = FAMILIES[name]
    kwargs = {**family.kwargs, "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None}
    return dataclasses.replace(family, name=f"{name}_generate", kwargs=kwargs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_no_cache_dynamo_export_of_other_families(family: str, tmp_path: Path) -> None:
    from corpus_export import build_model

    spec = _corpus_family(family)
    model = build_model(spec, "dynamo")
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "model.onnx"
    assert main(["export", str(tmp_path / "hf"), "-o", str(out), "--no-cache"]) == 0
    ids = [[5, 17, 99, 3, 42, 7]]
    engine = Engine.load(out)
    got = engine.run(engine.first_step_feeds({"input_ids": np.array(ids)})).outputs["logits"]
    np.testing.assert_allclose(got, _hf_logits(tmp_path / "hf", ids), rtol=1e-4, atol=1e-4)


def test_moe_bundle_runs_and_profiles_on_input_ids_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Qwen3-MoE (dynamic experts): run with input_ids only computes transformers' logits; profile on text counts
    every expert and measures impact through the force-off variant (which gets the same filled feeds)."""
    from corpus_export import get_generate_export

    folder = get_generate_export(_corpus_family("qwen3_moe"))
    bundle = tmp_path / "moe.lz"
    assert main(["compile", str(folder / "model.onnx"), "-o", str(bundle)]) == 0
    capsys.readouterr()
    assert main(["run", str(bundle), "--input", "input_ids=5,17,99,3", "--json"]) == 0
    logits = np.array(json.loads(capsys.readouterr().out)["outputs"]["logits"]["values"])
    np.testing.assert_allclose(logits, _hf_logits(folder / "hf", [[5, 17, 99, 3]]), rtol=1e-4, atol=1e-4)
    data = tmp_path / "calib.npz"
    np.savez(data, input_ids=np.random.default_rng(2).integers(0, 128, (3, 1, 4)))
    out = tmp_path / "profile.json"
    assert main(["profile", str(bundle), "--data", str(data), "-o", str(out), "--impact-samples", "2"]) == 0
    doc = json.loads(out.read_text())
    assert doc["traffic"]["tokens"] == 12 and doc["impact"]["samples"] == 2
    experts = [p for p in doc["paths"] if ".experts." in p["path"]]
    assert len(experts) == 8 and all(p["tokens"]["run"] + p["tokens"]["skipped"] == 12 for p in experts)
    assert any(isinstance(p["zeroing_impact"]["model"], float) for p in experts)
