"""bench/read_runs.py: the run-pattern read-rate diagnostic builds, runs and prints one positive rate per cell; bad
arguments exit 2 with one line. Its rates are not judged (a diagnostic, not a target)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "read_runs.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_read_runs_prints_a_rate_per_cell() -> None:
    if shutil.which("g++") is None or "avx512bw" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("bench/read_runs.cpp needs g++ and an AVX-512 (BW) CPU")
    proc = _run("--mib", "16", "--runs", "1024", "4096", "--skip", "0", "0.5", "--threads", "1", "2", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d\.\d\d)\s+(\d+\.\d)\s+(\d+\.\d)$", proc.stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [("1024", "0.00"), ("1024", "0.50"), ("4096", "0.00"), ("4096", "0.50")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), proc.stdout


def test_read_runs_refuses_bad_runs() -> None:
    proc = _run("--runs", "100")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["--runs must be multiples of 64 bytes and --skip in [0, 1)"]


def test_read_runs_refuses_a_cpu_without_avx512_in_one_line() -> None:
    if "avx512bw" in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has AVX-512 (BW): the refusal is for CPUs without it")
    proc = _run("--runs", "1024")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() in (
        ["this CPU has no AVX-512 (BW): read_runs.cpp is written for it"],
        ["g++ not found (apt-get install g++)"],
    )
