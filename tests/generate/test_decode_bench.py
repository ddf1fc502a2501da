"""bench/decode.py --weights int4 / int8 at a tiny size (``--quick --rounds 1 --new-tokens 4``): the path of every
column runs and its numbers are sane; the speed targets are not judged at this size.

The bench runs as a subprocess with its cache in a temporary folder (``XDG_CACHE_HOME``) and the test build of
liblayerzero_ort.so (``tests/plugins/native_build.py``). llama.cpp's columns need llama-cpp-python built here
(scripts/build_llamacpp.sh; CI does not build it): without it the table says why and the test checks that line.
LayerZero's own int4 / int8 column needs ``CompileOptions(weights=...)``: until it exists the bench says "not
available" and exits 1 (a missed target), which is checked too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the bench exports with torch (pip install -e '.[export]')")
pytest.importorskip("transformers", reason="the bench builds its model with transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.options import CompileOptions

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "decode.py"


def _has_llama_cpp() -> bool:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _llamacpp
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return _llamacpp.missing() is None


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One cache for the module (the export is shared by the int4 and int8 runs) and the test build of the library."""
    from tests.plugins.native_build import build_ort_test_library

    library = build_ort_test_library()
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")),
            "LAYERZERO_PLUGIN_DIR": str(library.parent)}  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_bench_quantized_columns(bench_env: dict[str, str], tmp_path: Path, bits: int) -> None:
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--families", "qwen3_moe", "--weights", f"int{bits}",
           "--rounds", "1", "--new-tokens", "4", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=bench_env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    text = done.stdout
    assert out.is_file(), done.stderr[-3000:]
    rows = {(r["column"], r["threads"]): r for r in json.loads(out.read_text())["results"]}

    # LayerZero fp32 native: the same model as the export (its logits, its greedy ids).
    for t in (1, 2):
        row = rows[("LZ fp32 native", t)]
        assert row["decode_tokens_per_s"] > 0
        assert row["top1_vs_fp32"] == 1.0 and row["rel_l2_vs_fp32"] < 1e-4
        assert row["ids_equal_fp32_leading"] == 4
    # ONNX Runtime's quantized form: it ran, checked once against MoE, and deviates as a quantization does.
    assert f"ORT int{bits}: QMoE checked once against MoE" in text
    for t in (1, 2):
        row = rows[(f"ORT int{bits}", t)]
        assert row["decode_tokens_per_s"] > 0
        assert 0 < row["rel_l2_vs_fp32"] < 0.5
    kind = "Q4_0" if bits == 4 else "Q8_0"
    if _has_llama_cpp():
        # The converted F32 GGUF is the same model: its logits are the export's to float rounding.
        assert rows[("llama.cpp F32", 1)]["rel_l2_vs_fp32"] < 1e-3
        assert 0 < rows[(f"llama.cpp {kind}", 2)]["rel_l2_vs_fp32"] < 0.5
    else:
        assert f"llama.cpp {kind}" in text and "llama_cpp not importable" in text
    if "weights" in {f.name for f in dataclasses.fields(CompileOptions)}:
        assert (f"LZ int{bits}", 1) in rows
        assert "read bound: LZ int" in text
        for t in (1, 2):  # LZ int's own weights streamed alone: some bytes, some rate (no speed is judged here:
            bound = rows[("read bound", t)]  # at --quick the model is a few MB and the stream's calls set its time)
            assert bound["bytes_per_token"] > 0 and bound["decode_tokens_per_s"] > 0
            assert len(bound["rounds"]) == 1
        assert done.returncode == 0, text[-3000:]
    else:
        assert f"LZ int{bits}                - not available: CompileOptions has no weights option" in text
        assert done.returncode == 1 and "MISSED:" in text
