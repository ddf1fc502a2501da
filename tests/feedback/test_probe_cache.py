"""The activation probe cache (``compiler/activation_runs.py`` ``ProbeCache``): a second ``compile
--activation-sparsity`` of the same model and calibration reads its probes instead of measuring them, and
allocates exactly as the first; off with ``LAYERZERO_PROBE_CACHE=0``; an unreadable cache file is measured over and
rewritten; the key follows the model's content."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.activation_runs import ProbeCache, model_key

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from tests.tiny_llama import prefill_feeds, tiny_llama_config  # noqa: E402

LAYERS, VOCAB, SEQ = 2, 128, 32  # tiny_llama_config: hidden 64, FFN 128, 4 / 2 heads of 16


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp("probe_cache")
    torch.manual_seed(0)
    config = tiny_llama_config(LAYERS, VOCAB, max_position_embeddings=128, initializer_range=0.2, eos_token_id=None,
                               bos_token_id=None)  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    np.savez(tmp / "calibration.npz", **prefill_feeds(VOCAB, LAYERS, SEQ))
    return tmp


def _compile(export: Path, out: str, level: float) -> dict:
    from layerzero.cli import main

    args = ["compile", str(export / "m.onnx"), "-o", str(export / out), "--activation-sparsity", str(level),
            "--activation-calibration", str(export / "calibration.npz"), "--max-deviation", "100"]  # fmt: skip
    assert main(args) == 0
    return json.loads((export / out / "manifest.json").read_text())["activation_sparsity"]


def test_second_compile_reads_the_probes(export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERZERO_PROBE_CACHE", str(tmp_path / "cache"))
    first = _compile(export, "a.lz", 0.3)
    assert first["probe_cache"]["measured"] > 0 and first["probe_cache"]["cached"] == 0, first["probe_cache"]
    files = list((tmp_path / "cache").glob("*.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())["deviations"]) == first["probe_cache"]["measured"]
    again = _compile(export, "b.lz", 0.3)
    assert again["probe_cache"] == {"measured": 0, "cached": first["probe_cache"]["measured"]}
    assert again["groups"] == first["groups"] and again["curve"] == first["curve"]
    other = _compile(export, "c.lz", 0.4)  # another level: the same probes (each group alone at PROBE_LEVELS)
    assert other["probe_cache"]["measured"] == 0 and other["probe_cache"]["cached"] > 0
    assert abs(other["realized_on_calibration"] - 0.4) < 0.02


def test_cache_off_and_unreadable(export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERZERO_PROBE_CACHE", "0")
    off = _compile(export, "off.lz", 0.3)
    assert off["probe_cache"]["cached"] == 0 and off["probe_cache"]["measured"] > 0
    cache = tmp_path / "cache"
    monkeypatch.setenv("LAYERZERO_PROBE_CACHE", str(cache))
    first = _compile(export, "d.lz", 0.3)
    (path,) = cache.glob("*.json")
    path.write_text("{not json")
    broken = _compile(export, "e.lz", 0.3)  # measured again, the file rewritten
    assert broken["probe_cache"] == first["probe_cache"] and broken["groups"] == first["groups"]
    assert len(json.loads(path.read_text())["deviations"]) == first["probe_cache"]["measured"]


def _tiny(weight: float) -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2]))
    w = ir.Value(name="w", const_value=ir.tensor(np.full((2, 2), weight, np.float32), name="w"))
    node = ir.Node("", "MatMul", [x, w], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 17})
    return ir.Model(graph, ir_version=9)


def test_the_key_follows_the_model_and_the_thresholds(tmp_path: Path) -> None:
    assert model_key(_tiny(1.0)) == model_key(_tiny(1.0)) != model_key(_tiny(2.0))
    requests = [{"x": np.ones((1, 2), np.float32)}]
    a = ProbeCache.open(_tiny(1.0), requests, tmp_path)
    b = ProbeCache.open(_tiny(1.0), [{"x": np.zeros((1, 2), np.float32)}], tmp_path)
    t = {"g": np.array([0.5, 0.25], np.float32)}
    assert a.key(t) != b.key(t)  # other requests
    assert a.key(t) != a.key({"g": np.array([0.5, 0.5], np.float32)}) != a.key({"h": t["g"]})
    a.store(a.key(t), 0.125)
    assert ProbeCache.open(_tiny(1.0), requests, tmp_path).entries == {a.key(t): 0.125}
    assert ProbeCache.open(_tiny(2.0), requests, tmp_path).entries == {}
