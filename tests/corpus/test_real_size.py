"""Real-size corpus cases: a dense Llama and an OLMoE-style MoE (64 experts, top-8, hidden 1024), each with
≥ 1 GB of external-data weights (above the 256 MB chunked-verification threshold), exported by
``torch.onnx.export(dynamo=True)`` (cached with the corpus) and compiled with the default options, verified.
The compile runs in a child process (tests/corpus/corpus_real.py) whose peak RSS is printed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytest.importorskip("torch", reason="the export corpus needs torch (pip install -e '.[export]')")
pytest.importorskip("transformers", reason="the export corpus needs transformers (pip install -e '.[export]')")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from corpus_export import cache_root  # noqa: E402
from corpus_real import MIN_BYTES  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = HERE / "corpus_real.py"


def _child(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{SCRIPT.name} {args[0]} {args[1]} failed ({proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _export(kind: str) -> Path:
    path = cache_root() / f"real-{kind}" / "model.onnx"
    if not path.exists():
        report = _child("export", kind, str(path))
        print(f"exported {kind}: peak RSS {report['peak_rss_mb']} MB")
    return path


@pytest.mark.parametrize(
    "kind",
    ["dense", "moe"],
)
def test_real_size_compiles_verified(kind: str, tmp_path: Path) -> None:
    path = _export(kind)
    data = path.with_name(path.name + ".data")
    assert data.stat().st_size >= MIN_BYTES, f"{data}: {data.stat().st_size} bytes, the case needs ≥ 1 GB"
    report = _child("compile", str(path), str(tmp_path / "model.lz"))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"real-size {kind}: {data.stat().st_size / 2**30:.2f} GB, compiled in {report['seconds']} s, "
          f"peak RSS {report['peak_rss_mb']} MB (children max {children} MB), nodes {report['nodes']}")  # fmt: skip
    assert report["passed"], report
    if kind == "moe":
        assert report["moe_blocks"] == 2, report  # both MoE blocks in the skipping form


BENCH = HERE.parents[1] / "bench" / "real_size.py"


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**20


def test_olmoe_7b_shape_export_compile_int4_generate(tmp_path: Path) -> None:
    """Issue 22 at real size: OLMoE-1B-7B's shape (16 layers; ``LAYERZERO_REAL_LAYERS`` for fewer) in bf16 through
    export, compile --weights int4 and generate 16 tokens (bench/real_size.py, each step a child with its own peak
    RSS printed); the bench exits 1 when compile's peak RSS exceeds the int4 bundle + 2 GB."""
    if os.environ.get("LAYERZERO_REAL_SIZE") != "1":
        # Measured (bench/README.md, the 16-layer run): compile 253 s, peak 5.72 GB against the bound 6.13 GB
        # (bundle 4.08 GB + 2 GB); export 109 s at 13.75 GB (file-backed pages), generate 3 s. It writes ~31 GB
        # (bf16 folder, export, bundle) and needs the native MoE kernel (liblayerzero_ort.so): the bench refuses
        # to compile without it.
        pytest.skip("the 7B-class run is opt-in (LAYERZERO_REAL_SIZE=1): ~8 minutes on a quiet machine, ~31 GB of "
                    "disk, ~17 GB of available memory")  # fmt: skip
    layers = int(os.environ.get("LAYERZERO_REAL_LAYERS", "16"))
    need = 0.9 * layers + 0.5 + 2.0  # bf16 bytes of the model (the export holds them: ~1.35x, file-backed) + slack
    if _available_gb() < need:
        pytest.skip(f"{layers} OLMoE layers need ~{need:.0f} GB of available memory, {_available_gb():.1f} GB free")
    work = Path(os.environ.get("LAYERZERO_REAL_WORK", tmp_path))
    proc = subprocess.run([sys.executable, str(BENCH), "--layers", str(layers), "--work", str(work)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
