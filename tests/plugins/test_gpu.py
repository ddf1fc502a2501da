"""GPU tests: the kernels against the numpy reference, the TensorRT plan against ONNX Runtime.

They need an NVIDIA GPU and cuda-python (and, for the plan, ``tensorrt`` plus liblayerzero_trt.so) and skip
otherwise. They reuse scripts/gpu_check.py, the script a GPU machine runs (scripts/gpu_check.sh).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("layerzero_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def device(gpu_present, gpu_check):
    if not gpu_present:
        pytest.skip("needs an NVIDIA GPU and cuda-python (pip install cuda-python)")
    dev = gpu_check.Device()
    yield dev
    dev.free_all()


def test_kernels_match_the_numpy_reference(device, gpu_check, kernels_path):
    from layerzero.plugins.loader import load_kernels

    report: dict = {}
    assert gpu_check.check_correctness(load_kernels(kernels_path), device, report), report


def test_tensorrt_plan_matches_onnxruntime(device, gpu_check, kernels_build):
    pytest.importorskip("tensorrt", reason="needs the tensorrt package")
    if "liblayerzero_trt.so" not in kernels_build.built:
        pytest.skip(f"liblayerzero_trt.so not built: {kernels_build.not_built.get('liblayerzero_trt.so')}")
    report: dict = {}
    assert gpu_check.check_tensorrt(kernels_build.build_dir, report), report
