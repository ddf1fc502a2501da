"""The native libraries against real TensorRT headers, on a CPU: every built library loads, the glue compiles
without a warning in our files, and a C++ lifecycle harness drives liblayerzero_trt.so the way TensorRT does.

The headers are TensorRT 10.14's, from the pinned ``kernel-lens`` wheel (the ``trt_headers`` fixture of
conftest.py: ``scripts/fetch_trt_headers.sh``, version + sha256; or ``LAYERZERO_TRT_HEADERS=<dir>``). Where
libnvinfer is absent the libraries link and load against ``harness/nvinfer_stub.cpp``, a link-only stand-in
built here. Missing nvcc / cmake / g++ / headers skip, or fail under ``LAYERZERO_REQUIRE_NATIVE=1`` (CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerzero.plugins import loader

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "harness"
GLUE_SOURCES = ("moe_plugin.cpp", "plugin_library.cpp", "register.cpp")


@pytest.fixture(scope="session")
def cxx(missing) -> str:
    path = shutil.which("g++") or shutil.which("c++")
    if path is None:
        missing("no C++ compiler (g++) found")
    return path


@pytest.fixture(scope="session")
def cuda_headers(cuda_include, missing) -> Path:
    include = cuda_include
    if not (include / "cuda_runtime_api.h").is_file():
        missing(f"CUDA headers (cuda_runtime_api.h) not found in {include}; install the CUDA toolkit")
    return include


@pytest.fixture(scope="session")
def trt_root(tmp_path_factory, trt_headers, cxx, cuda_headers, tools) -> Path:
    """A TensorRT root (include/, lib/) for the build: the real libnvinfer when one is installed, else the stub."""
    root = tmp_path_factory.mktemp("tensorrt-root")
    (root / "include").symlink_to(trt_headers, target_is_directory=True)
    lib = root / "lib"
    lib.mkdir()
    real = tools["tensorrt_library"]
    if real.found:
        (lib / "libnvinfer.so").symlink_to(real.path)
        return root
    cmd = [cxx, "-shared", "-fPIC", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"]
    cmd += ["-isystem", str(trt_headers), "-isystem", str(cuda_headers), str(HARNESS / "nvinfer_stub.cpp")]
    cmd += ["-o", str(lib / "libnvinfer.so.10"), "-Wl,-soname,libnvinfer.so.10", "-Wl,--no-undefined"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (lib / "libnvinfer.so").symlink_to("libnvinfer.so.10")
    return root


@pytest.fixture(scope="session")
def native_build(tmp_path_factory, trt_root, tools, missing) -> loader.BuildReport:
    """``build_plugins`` with TensorRT found (real headers; real or stub libnvinfer): all three libraries."""
    if not tools["cmake"].found:
        missing(f"cmake not found: {tools['cmake'].note}")
    if not tools["nvcc"].found:
        missing(f"nvcc not found: {tools['nvcc'].note}")
    report = loader.build_plugins(tmp_path_factory.mktemp("native-build"), tensorrt_root=trt_root)
    assert report.ok, report.summary() + "\n" + report.log[-3000:]
    return report


def test_a_missing_prerequisite_fails_when_native_is_required(missing, monkeypatch):
    monkeypatch.setenv("LAYERZERO_REQUIRE_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception, match="LAYERZERO_REQUIRE_NATIVE=1 but nvcc not found"):
        missing("nvcc not found")
    monkeypatch.delenv("LAYERZERO_REQUIRE_NATIVE")
    with pytest.raises(pytest.skip.Exception, match="nvcc not found"):
        missing("nvcc not found")


def _library_env(trt_root: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(trt_root / "lib"), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return dict(os.environ, LD_LIBRARY_PATH=path)


def test_every_built_library_loads(native_build, trt_root):
    # A fresh process per library: an unresolved symbol (the register library once needed a hidden C++ symbol of
    # liblayerzero_trt.so) fails here with the loader's own message.
    assert set(loader.LIBRARIES.values()) <= set(native_build.built), native_build.summary()
    for name in loader.LIBRARIES.values():
        code = f"import ctypes, sys\nctypes.CDLL({str(native_build.built[name])!r})\nprint('loaded')\n"
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=_library_env(trt_root), timeout=120
        )
        assert proc.returncode == 0 and "loaded" in proc.stdout, f"{name}: {proc.stderr.strip()[-2000:]}"


def test_register_library_registers_the_creator_on_load(native_build, trt_root):
    stub = trt_root / "lib" / "libnvinfer.so.10"
    if not stub.is_file() or stub.is_symlink():
        pytest.skip("a real libnvinfer is installed: the registration counter is a hook of the tests' stub")
    code = (
        "import ctypes\n"
        f"stub = ctypes.CDLL({str(stub)!r}, mode=ctypes.RTLD_GLOBAL)\n"
        f"ctypes.CDLL({str(native_build.built[loader.LIBRARIES['trt_register']])!r})\n"
        "print(stub.lz_stub_registered_creators(), stub.lz_stub_logged_errors())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "0"], proc.stdout + proc.stderr


def test_shared_libraries_link_with_no_undefined(native_build):
    # --no-undefined turns a call into a hidden symbol of another library into a link error, not a dlopen error.
    for target in ("layerzero_kernels", "layerzero_trt", "layerzero_trt_register"):
        link = (native_build.build_dir / "CMakeFiles" / f"{target}.dir" / "link.txt").read_text()
        assert "--no-undefined" in link, f"{target}: {link}"


def test_register_library_imports_only_c_symbols_of_the_plugin(native_build):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not found: cannot list the undefined symbols of the register library")
    library = native_build.built[loader.LIBRARIES["trt_register"]]
    out = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(library)], capture_output=True, text=True).stdout
    assert "layerzero::" not in out, out
    assert re.search(r"\bgetCreators\b", out) and re.search(r"\bgetPluginRegistry\b", out), out


@pytest.mark.parametrize("source", GLUE_SOURCES)
def test_glue_compiles_against_real_headers_without_warnings(source, cxx, trt_headers, cuda_headers):
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror"]
    cmd += ["-isystem", str(trt_headers), "-isystem", str(cuda_headers), f"-I{loader.source_dir() / 'include'}"]
    cmd.append(str(loader.source_dir() / "src" / source))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_run_plan_example_compiles_against_real_headers_without_warnings(cxx, trt_headers, cuda_headers):
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
    cmd += ["-isystem", str(trt_headers), "-isystem", str(cuda_headers)]
    cmd.append(str(loader.source_dir() / "examples" / "run_plan.cpp"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_cmake_build_has_no_warning_in_our_files(native_build):
    ours = [line for line in native_build.log.splitlines() if "warning" in line.lower() and "/plugins/" in line]
    assert not ours, "\n".join(ours)


def test_lifecycle_harness(native_build, trt_root, trt_headers, cuda_headers, cxx, tmp_path):
    harness = tmp_path / "lifecycle"
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"]
    cmd += ["-isystem", str(trt_headers), "-isystem", str(cuda_headers), str(HARNESS / "lifecycle.cpp")]
    cmd += ["-o", str(harness), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    library = native_build.built[loader.LIBRARIES["trt"]]
    proc = subprocess.run(
        [str(harness), str(library)], capture_output=True, text=True, env=_library_env(trt_root), timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("LIFECYCLE PASSED"), proc.stdout
    for step in ("creator:", "supportsFormatCombination", "configurePlugin", "attachToContext", "enqueue with T = 0"):
        assert any(step in line for line in lines), f"{step} missing:\n{proc.stdout}"
