"""Fixtures of the plugin tests: one CMake build of ``plugins/`` per session, and a hand-made MoE graph.

Builds go to a session temp dir (never the user's ~/.cache). Tests that need nvcc, cmake, TensorRT or a GPU
skip with a reason that names what is missing; with ``LAYERZERO_REQUIRE_NATIVE=1`` (CI) a missing native
prerequisite (nvcc, cmake, a C++ compiler, the TensorRT headers) fails instead (``native_missing``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins import loader
from tests.plugins.native_build import build_ort_test_library
from tests.plugins.native_build import missing as native_missing

FAKE_TENSORRT = Path(__file__).parent / "fake_tensorrt"
FETCH_TRT_HEADERS = Path(__file__).resolve().parents[2] / "scripts" / "fetch_trt_headers.sh"


MASK_NAME = "layerzero::mask::layers.0.moe"


def cuda_include_dir() -> Path:
    """Where cuda_runtime_api.h is (the plugin glue includes it)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c) / "include"
    return Path("/usr/local/cuda/include")


def has_gpu() -> bool:
    """A CUDA device and cuda-python to reach it (the GPU tests' prerequisites)."""
    try:
        from layerzero.runtime.backends._cuda import import_cudart

        rt = import_cudart()
    except ImportError:
        return False
    err, count = rt.cudaGetDeviceCount()
    return int(err) == 0 and count > 0


@pytest.fixture(scope="session")
def missing():
    """``native_missing`` for test modules (``from conftest import`` clashes with sibling test folders)."""
    return native_missing


@pytest.fixture(scope="session")
def trt_headers(missing) -> Path:
    """A directory with real TensorRT headers (NvInferRuntime.h): $LAYERZERO_TRT_HEADERS, else the pinned wheel."""
    given = os.environ.get("LAYERZERO_TRT_HEADERS")
    if given:
        if not (Path(given) / "NvInferRuntime.h").is_file():
            missing(f"LAYERZERO_TRT_HEADERS={given} holds no NvInferRuntime.h")
        return Path(given)
    if shutil.which("bash") is None:
        missing("bash not found: cannot run scripts/fetch_trt_headers.sh")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    dest = Path(cache) / "layerzero" / "trt-headers-10.14"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(FETCH_TRT_HEADERS), str(dest)], capture_output=True, text=True, env=env, timeout=300
    )
    if proc.returncode != 0:
        missing(f"TensorRT headers: scripts/fetch_trt_headers.sh failed: {proc.stderr.strip()[-500:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def gpu_present() -> bool:
    return has_gpu()


@pytest.fixture(scope="session")
def cuda_include() -> Path:
    return cuda_include_dir()


@pytest.fixture(scope="session")
def tools() -> dict[str, loader.Tool]:
    return loader.find_tools()


@pytest.fixture(scope="session")
def kernels_build(tmp_path_factory, tools) -> loader.BuildReport:
    """``build_plugins`` in this machine's environment (kernels when nvcc exists; TensorRT when found)."""
    if not tools["cmake"].found:
        native_missing(f"cmake not found: {tools['cmake'].note}")
    if not tools["nvcc"].found:
        native_missing(f"nvcc not found: {tools['nvcc'].note}")
    report = loader.build_plugins(tmp_path_factory.mktemp("plugins-build"))
    assert report.ok, report.summary() + "\n" + report.log[-3000:]
    return report


@pytest.fixture(scope="session")
def kernels_path(kernels_build) -> Path:
    return kernels_build.built[loader.LIBRARIES["kernels"]]


def moe_node_model(
    *,
    tokens: int | str = "T",
    hidden: int = 16,
    ffn: int = 32,
    experts: int = 4,
    top_k: int = 2,
    dtype: int = TensorProto.FLOAT,
    logits_dtype: int | None = None,
    mask_output: bool = True,
    attributes: dict | None = None,
    seed: int = 0,
) -> onnx.ModelProto:
    """One ``ai.layerzero::MoE`` node, built by hand: router ``Gemm`` -> MoE -> (y, mask) graph outputs."""
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)

    def init(name: str, shape: tuple[int, ...], np_type=np_dtype) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np_type), name)

    logits_type = logits_dtype if logits_dtype is not None else dtype
    initializers = [
        init("router", (experts, hidden), helper.tensor_dtype_to_np_dtype(logits_type)),
        init("w_gate", (experts, ffn, hidden)),
        init("w_up", (experts, ffn, hidden)),
        init("w_down", (experts, hidden, ffn)),
    ]
    nodes = []
    router_input = "hidden"
    if logits_type != dtype:
        nodes.append(helper.make_node("Cast", ["hidden"], ["hidden_for_router"], to=logits_type))
        router_input = "hidden_for_router"
    nodes.append(helper.make_node("Gemm", [router_input, "router"], ["logits"], transB=1, name="router"))
    attrs = {
        "top_k": top_k,
        "normalize": 1,
        "scoring": "softmax",
        "activation": "silu",
        "zeroing_threshold": 0.0,
        "path": "layers.0.moe",
    }
    attrs.update(attributes or {})
    outputs = ["y", MASK_NAME] if mask_output else ["y"]
    nodes.append(
        helper.make_node(
            "MoE",
            ["hidden", "logits", "w_gate", "w_up", "w_down"],
            outputs,
            domain="ai.layerzero",
            name="layers.0.moe",
            **attrs,
        )
    )
    graph_outputs = [helper.make_tensor_value_info("y", dtype, [tokens, hidden])]
    if mask_output:
        graph_outputs.append(helper.make_tensor_value_info(MASK_NAME, TensorProto.BOOL, [tokens, experts]))
    graph = helper.make_graph(
        nodes,
        "moe_node",
        [helper.make_tensor_value_info("hidden", dtype, [tokens, hidden])],
        graph_outputs,
        initializers,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)], ir_version=10
    )


@pytest.fixture
def moe_model():
    return moe_node_model


@pytest.fixture
def nvcc(tools) -> str:
    if not tools["nvcc"].found:
        native_missing(f"nvcc not found: {tools['nvcc'].note}")
    return tools["nvcc"].path


@pytest.fixture
def gxx() -> str:
    path = shutil.which("g++") or shutil.which("c++")
    if path is None:
        native_missing("no C++ compiler (g++) found")
    return path


@pytest.fixture(scope="session")
def ort_lib() -> Path:
    """liblayerzero_ort.so, built once per session (tests/plugins/native_build.py)."""
    return build_ort_test_library(asan=False)


@pytest.fixture(scope="session")
def ort_lib_asan() -> Path:
    """liblayerzero_ort.so built with AddressSanitizer, once per session."""
    return build_ort_test_library(asan=True)
