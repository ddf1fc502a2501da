"""The native side on a CPU machine: the kernels compile with nvcc, the plugin glue compiles against TensorRT's
plugin API, ``build_plugins`` / ``layerzero plugins build`` report what they built and what not, and the C ABI
answers through ctypes (config checks, workspace sizes, errors) without a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from layerzero.cli import main
from layerzero.plugins import loader

PLUGINS = loader.source_dir()
KERNELS = loader.LIBRARIES["kernels"]
TRT = loader.LIBRARIES["trt"]
REGISTER = loader.LIBRARIES["trt_register"]
GLUE_SOURCES = ("moe_plugin.cpp", "plugin_library.cpp", "register.cpp")


def test_kernels_compile_with_nvcc_for_sm90_and_ptx(kernels_build):
    # The session build compiled moe_kernels.cu with nvcc: sm_90 machine code plus compute_90 PTX for newer GPUs.
    flags = (kernels_build.build_dir / "CMakeFiles" / "layerzero_kernels_obj.dir" / "flags.make").read_text()
    assert "arch=compute_90,code=[sm_90]" in flags
    assert "arch=compute_90,code=[compute_90]" in flags
    library = kernels_build.built[KERNELS]
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not found: cannot list the exported symbols of the kernels library")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    symbols = {line.split()[-1] for line in exported.splitlines() if line.strip()}
    assert {"lz_moe_forward", "lz_moe_forward_f32", "lz_moe_forward_f16", "lz_moe_forward_bf16"} <= symbols
    assert {"lz_moe_route", "lz_moe_workspace_size", "lz_last_error"} <= symbols
    assert all(s.startswith("lz_") or s.startswith("_") for s in symbols), symbols  # kernels stay hidden


def test_plugin_glue_compiles_against_tensorrt_headers(tools, gxx, cuda_include, request):
    # This machine's TensorRT headers, else the pinned kernel-lens copy of 10.14's (the trt_headers fixture).
    headers = tools["tensorrt_headers"]
    include = Path(headers.path) if headers.found else request.getfixturevalue("trt_headers")
    for source in GLUE_SOURCES:
        _syntax_check(gxx, source, include, cuda_include)


def test_plugin_glue_compiles_against_the_documented_plugin_api(gxx, cuda_include):
    # The stand-in declares only the documented signatures the glue uses: it catches C++ mistakes on machines
    # without TensorRT; it is no substitute for the test above.
    if not (cuda_include / "cuda_runtime_api.h").is_file():
        pytest.skip(f"CUDA headers (cuda_runtime_api.h) not found in {cuda_include}")
    for source in GLUE_SOURCES:
        _syntax_check(gxx, source, Path(__file__).parent / "fake_tensorrt" / "include", cuda_include)


def _syntax_check(gxx: str, source: str, trt_include: Path, cuda_include: Path) -> None:
    # -isystem for TensorRT and CUDA: their headers warn about their own deprecated declarations; ours must not.
    cmd = [gxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra"]
    cmd += ["-isystem", str(trt_include), f"-I{PLUGINS / 'include'}", "-isystem", str(cuda_include)]
    cmd.append(str(PLUGINS / "src" / source))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{source}:\n{proc.stderr}"
    assert "warning" not in proc.stderr, proc.stderr


def test_build_reports_kernels_built_and_tensorrt_missing(kernels_build, tools):
    report = kernels_build
    assert report.ok and report.kernels_built
    assert report.built[KERNELS].is_file()
    summary = report.summary()
    assert f"built      {KERNELS}" in summary
    assert "nvcc:" in summary and "cmake:" in summary
    if tools["tensorrt_headers"].found and tools["tensorrt_library"].found:
        assert TRT in report.built and REGISTER in report.built
    else:
        assert TRT not in report.built
        assert "TensorRT" in report.not_built[TRT]
        assert "not built  liblayerzero_trt.so" in summary


def test_build_with_tensorrt_headers_but_no_library_builds_the_glue_only(tmp_path, tools):
    if not (tools["cmake"].found and tools["nvcc"].found):
        pytest.skip("needs cmake and nvcc")
    if tools["tensorrt_library"].found:
        pytest.skip(f"a libnvinfer is installed ({tools['tensorrt_library'].path}): the stand-in headers would link it")
    fake_root = Path(__file__).parent / "fake_tensorrt"
    report = loader.build_plugins(tmp_path, tensorrt_root=fake_root)
    assert report.ok, report.summary() + report.log[-3000:]
    assert report.kernels_built
    assert loader.GLUE in report.built
    assert "not libnvinfer" in report.not_built[TRT]
    assert TRT in report.not_built[REGISTER]


def test_build_without_nvcc_builds_nothing_and_says_why(tmp_path, monkeypatch, tools):
    if not tools["cmake"].found:
        pytest.skip("cmake not found")
    monkeypatch.setattr(loader, "_find_nvcc", lambda: loader.Tool("nvcc", None, note="not on PATH"))
    report = loader.build_plugins(tmp_path)
    assert report.ok and not report.built
    assert "nvcc" in report.not_built[KERNELS]
    assert "no CUDA compiler" in report.not_built[TRT]


def test_build_without_cmake_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_find_cmake", lambda: loader.Tool("cmake", None, note="install cmake"))
    report = loader.build_plugins(tmp_path)
    assert not report.ok and "cmake not found" in report.error
    assert set(report.not_built) == set(loader.LIBRARIES.values())


def test_cli_plugins_build_prints_what_it_built(kernels_build, capsys):
    assert main(["plugins", "build", "--build-dir", str(kernels_build.build_dir)]) == 0
    out = capsys.readouterr().out
    assert f"built      {KERNELS}" in out
    assert "TensorRT headers:" in out and "nvcc:" in out
    if TRT not in kernels_build.built:
        assert f"not built  {TRT}" in out


def test_cli_plugins_build_without_nvcc_exits_2(tmp_path, monkeypatch, capsys, tools):
    if not tools["cmake"].found:
        pytest.skip("cmake not found")
    monkeypatch.setattr(loader, "_find_nvcc", lambda: loader.Tool("nvcc", None, note="not on PATH"))
    assert main(["plugins", "build", "--only", "cuda", "--build-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "nothing was built" in captured.err and "nvcc" in captured.err


def test_cli_plugins_info(kernels_build, capsys):
    assert main(["plugins", "info", "--build-dir", str(kernels_build.build_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{KERNELS}: {kernels_build.built[KERNELS]}" in out


def test_plugin_library_path_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.delenv("LAYERZERO_PLUGIN_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(loader.PluginError, match="layerzero plugins build"):
        loader.plugin_library_path("trt", tmp_path / "nowhere")
    with pytest.raises(loader.PluginError, match="unknown plugin library"):
        loader.plugin_library_path("nope")


def test_plugin_library_path_honours_the_environment(kernels_path, monkeypatch):
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(kernels_path.parent))
    assert loader.plugin_library_path("kernels") == kernels_path


# ------------------------------------------------------------------------------------------- the C ABI


def test_c_abi_checks_configs_and_sizes_workspaces(kernels_path):
    lib = loader.load_kernels(kernels_path)
    config = loader.MoEConfig.make(tokens=64, hidden=512, ffn=1024, experts=8, top_k=2)
    size = lib.workspace_size(config)
    # The fp32 intermediate and expert outputs dominate: T*k*(F+H)*4 bytes.
    assert 64 * 2 * (1024 + 512) * 4 <= size <= 64 * 2 * (1024 + 512) * 4 + 64 * 1024
    bigger = loader.MoEConfig.make(tokens=128, hidden=512, ffn=1024, experts=8, top_k=2)
    assert lib.workspace_size(bigger) > size
    bad = [
        (dict(top_k=9), "top_k = 9"),
        (dict(top_k=0), "top_k = 0"),
        (dict(experts=9000), "experts (E) = 9000"),
        (dict(hidden=0), "hidden (H) = 0"),
        (dict(zeroing_threshold=-1.0), "zeroing_threshold"),
        (dict(normalize=2), "normalize = 2"),
    ]
    for change, message in bad:
        kwargs = dict(tokens=4, hidden=8, ffn=8, experts=8, top_k=2) | change
        with pytest.raises(loader.PluginError, match="invalid argument"):
            lib.check_config(loader.MoEConfig.make(**kwargs))
        try:
            lib.check_config(loader.MoEConfig.make(**kwargs))
        except loader.PluginError as e:
            assert message in str(e)


def test_c_abi_zero_tokens_is_a_noop_and_bad_dtypes_are_named(kernels_path):
    lib = loader.load_kernels(kernels_path)
    empty = loader.MoEConfig.make(tokens=0, hidden=8, ffn=8, experts=4, top_k=2)
    pointers = dict(hidden=0, router_logits=0, w_gate=0, w_up=0, w_down=0, y=0, mask=None)
    lib.forward(empty, "float32", **pointers, workspace=None, workspace_size=0)
    with pytest.raises(loader.PluginError, match="dtype"):
        lib.forward(empty, "int8", **pointers, workspace=None, workspace_size=0)
    one = loader.MoEConfig.make(tokens=1, hidden=8, ffn=8, experts=4, top_k=2)
    with pytest.raises(loader.PluginError, match="hidden is NULL"):
        lib.forward(one, "float16", **pointers, workspace=256, workspace_size=1 << 20)
    with pytest.raises(loader.PluginError, match="workspace too small"):
        fake = dict(pointers, hidden=256, router_logits=256, w_gate=256, w_up=256, w_down=256, y=256)
        lib.forward(one, "bfloat16", **fake, workspace=256, workspace_size=16)


def test_c_abi_reports_a_missing_gpu_as_a_cuda_error(kernels_path, gpu_present):
    if gpu_present:
        pytest.skip("a GPU is present: launching on fake pointers would fault; the GPU tests cover launches")
    if Path("/dev/nvidia0").exists():
        pytest.skip("an NVIDIA device node exists; not risking a launch on fake pointers")
    lib = loader.load_kernels(kernels_path)
    config = loader.MoEConfig.make(tokens=2, hidden=8, ffn=8, experts=4, top_k=2)
    fake = dict(hidden=256, router_logits=256, w_gate=256, w_up=256, w_down=256, y=256, mask=None)
    with pytest.raises(loader.PluginError, match="CUDA error"):
        lib.forward(config, "float32", **fake, workspace=256, workspace_size=lib.workspace_size(config))


def test_cli_plugins_build_defaults_to_layerzero_plugin_dir(tmp_path, monkeypatch, capsys):
    # Where the libraries are looked for first is where `plugins build` puts them when no --build-dir is given
    # (it used to build into ~/.cache whatever LAYERZERO_PLUGIN_DIR said).
    from layerzero.plugins import ort_library

    built_in: list[Path | None] = []

    def fake_build(build_dir, asan=False, jobs=2):
        built_in.append(build_dir)
        raise loader.PluginError("cmake not found (test)")

    monkeypatch.setattr(ort_library, "build_ort_library", fake_build)
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(tmp_path / "env-dir"))
    assert main(["plugins", "build", "--only", "ort"]) == 2
    assert built_in == [tmp_path / "env-dir"]
    assert main(["plugins", "build", "--only", "ort", "--build-dir", str(tmp_path / "given")]) == 2
    assert built_in[-1] == tmp_path / "given"
    capsys.readouterr()
