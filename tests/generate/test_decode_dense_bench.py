"""bench/decode_dense.py --quick: the dense Llama bench's path end to end (every column compiled, loaded, run; the
table, the deviation and the realized sparsity printed), not its speed (no target is judged at --quick)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COLUMNS = {"ORT fp32", "LZ fp32", "ORT int4", "LZ int4", "LZ fp32 sparse 0.3", "LZ int4 sparse 0.3",
           "LZ fp32 sparse 0.5", "LZ int4 sparse 0.5"}  # fmt: skip


def test_decode_dense_quick(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    out = tmp_path / "dense.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "decode_dense.py"), "--quick", "--threads", "1,2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no target at --quick" in proc.stdout and "MISSED" not in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    rows = {(r["column"], r["threads"]): r for r in doc["results"]}
    # LZ int4 native (QLinear + Attention) runs where the bench built liblayerzero_ort.so; else its note says why.
    native = any(n.startswith("LZ int4 native: compiled") for n in doc["notes"])
    assert native or any(n.startswith("LZ int4 native: not run") for n in doc["notes"]), doc["notes"]
    natives = {"LZ int4 native", "LZ int4 native sparse 0.3", "LZ int4 native sparse 0.5"}
    assert {c for c, _ in rows} == COLUMNS | (natives if native else set())
    assert {t for _, t in rows} == {1, 2}
    for (column, _), r in rows.items():
        assert r["decode_tokens_per_s"] > 0 and r["median_step_s"] > 0, column
        if column in ("ORT fp32", "LZ fp32"):  # the fp32 compile is the export's model: the same logits and ids
            assert r["rel_l2_vs_fp32"] < 1e-4 and r["top1_vs_fp32"] == 1.0, (column, r)
        else:  # quantized / sparsified: a deviation, finite and measured
            assert 0 < r["rel_l2_vs_fp32"] < 1.5, (column, r)
        if "sparse" in column:  # calibrated on other prompts: the bench prompt's realized sparsity is near the target
            s = float(column.rsplit(" ", 1)[1])
            assert abs(r["realized_sparsity_prefill"] - s) < 0.1, (column, r)
            assert abs(r["realized_sparsity_decode"] - s) < 0.15, (column, r)
        else:
            assert r["realized_sparsity_prefill"] is None, column
