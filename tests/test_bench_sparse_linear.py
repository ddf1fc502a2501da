"""bench/sparse_linear.py on one layer: every column built, loaded and run, LayerZero's dense int4 QLinear next to
SparseLinear q4 on the same weights (their outputs at s = 0 agree), SparseLinear q4 grouped as a compile writes it
(q/k/v, gate/up one node each) bitwise the separate nodes, the ratios against QLinear printed. Its speed is not
judged here (one layer, three rounds): the exit status may be 1 for a missed target, never 2 or a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layerzero.plugins import ort_library

REPO = Path(__file__).resolve().parents[1]


def test_sparse_linear_bench_one_layer() -> None:
    if ort_library.find_ort_library() is None:
        if os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1":
            pytest.fail("liblayerzero_ort.so is not built and LAYERZERO_REQUIRE_NATIVE=1")
        pytest.skip("liblayerzero_ort.so not built (layerzero plugins build --only ort)")
    cmd = [sys.executable, str(REPO / "bench" / "sparse_linear.py"), "--layers", "1", "--rounds", "3",
           "--threads", "1", "--sparsity", "0", "0.5"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ))
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout
    dev = re.search(r"QLinear q4 vs SparseLinear q4 at s = 0 \(the same weights\): max rel\. deviation (\S+)", out)
    assert dev is not None and float(dev.group(1)) < 1e-4, out
    ql = re.search(r"ours QLinear q4 \(dense\) (\d+\.\d+)", out)
    assert ql is not None and float(ql.group(1)) > 0, out
    rows = {float(m.group(1)): m for m in re.finditer(r"^  (0\.\d)\s+(\d\.\d+)\s.*\s(\d+\.\d+)x$", out, re.M)}
    assert set(rows) == {0.0, 0.5}, out
    assert abs(float(rows[0.5].group(2)) - 0.5) < 0.05, out  # realized sparsity at s = 0.5
    assert re.search(r"ours-q4g \d+\.\d+x ours QLinear q4 dense \(>= 1\.7: (met|NOT met)\)", out), out
    assert "SparseLinear q4 grouped vs alone, every s: bitwise equal" in out, out
