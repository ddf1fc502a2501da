"""Find, build and load the LayerZero native libraries.

    from layerzero.plugins.loader import build_plugins, load_kernels, plugin_library_path

    report = build_plugins("build/plugins")        # cmake + nvcc (+ TensorRT when found)
    print(report.summary())
    kernels = load_kernels()                        # ctypes over liblayerzero_kernels.so
    plugin = plugin_library_path("trt")             # liblayerzero_trt.so, for IPluginRegistry.load_library

Libraries (``plugins/CMakeLists.txt`` builds them):

- ``liblayerzero_kernels.so``: the CUDA kernels behind the C ABI of ``include/layerzero_kernels.h``; needs nvcc,
  not TensorRT.
- ``liblayerzero_trt.so``: the TensorRT plugin ``layerzero::LayerZeroMoE`` v1 plus the kernels; exports
  ``getCreators`` (``IPluginRegistry::loadLibrary``, ``trtexec --dynamicPlugins``).
- ``liblayerzero_trt_register.so``: registers the plugin when loaded (``LD_PRELOAD``, Triton ``plugins=``,
  ``trtexec --staticPlugins``).

Where a library is looked for, in order: the path in ``LAYERZERO_PLUGIN_DIR`` (a directory), the build directory
passed in, then the default build directory (``$XDG_CACHE_HOME/layerzero/plugins``, i.e.
``~/.cache/layerzero/plugins``).

This module imports nothing of ours (``docs/architecture.md``: ``plugins`` is a leaf); its errors are ``PluginError``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "ABI_VERSION",
    "LIBRARIES",
    "BuildReport",
    "KernelLibrary",
    "MoEConfig",
    "PluginError",
    "build_plugins",
    "default_build_dir",
    "find_tools",
    "load_kernels",
    "plugin_library_path",
    "source_dir",
]

logger = logging.getLogger(__name__)

#: The C ABI version this module speaks (LZ_KERNELS_ABI_VERSION in layerzero_kernels.h).
ABI_VERSION = 1

#: Short name -> file name of each library the CMake project can build.
LIBRARIES = {
    "kernels": "liblayerzero_kernels.so",
    "trt": "liblayerzero_trt.so",
    "trt_register": "liblayerzero_trt_register.so",
}

#: The plugin compiled against the TensorRT headers, as object files (built whenever the headers are found).
GLUE = "TensorRT plugin glue (objects)"

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
SCORING_CODES = {"softmax": 0, "sigmoid": 1}
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "relu": 2}


class PluginError(RuntimeError):
    """A native library is missing, cannot be built, or failed; the message says what to do."""


def source_dir() -> Path:
    """The CMake project (``plugins/``: CMakeLists.txt, src/, include/)."""
    return Path(__file__).resolve().parent


def default_build_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "layerzero" / "plugins"


# --------------------------------------------------------------------------------------------- finding tools


@dataclasses.dataclass
class Tool:
    name: str
    path: str | None
    version: str | None = None
    note: str = ""

    @property
    def found(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        if not self.found:
            return f"{self.name}: not found{f' ({self.note})' if self.note else ''}"
        return f"{self.name}: {self.path}{f' ({self.version})' if self.version else ''}"


def _run_version(cmd: list[str], pattern: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(pattern, out)
    return match.group(1) if match else None


def _find_nvcc() -> Tool:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "nvcc"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Tool("nvcc", c, _run_version([c, "--version"], r"release ([0-9.]+)"))
    return Tool("nvcc", None, note="install the CUDA toolkit, or set CUDACXX / CUDA_HOME")


def _find_cmake() -> Tool:
    path = shutil.which("cmake")
    if path is None:
        return Tool("cmake", None, note="install cmake >= 3.24 (apt-get install cmake, or pip install cmake)")
    return Tool("cmake", path, _run_version([path, "--version"], r"cmake version ([0-9.]+)"))


def _tensorrt_roots(tensorrt_root: str | os.PathLike[str] | None) -> list[Path]:
    roots = [
        tensorrt_root,
        os.environ.get("TENSORRT_ROOT"),
        os.environ.get("TRT_ROOT"),
        os.environ.get("TENSORRT_HOME"),
    ]
    roots += ["/usr", "/usr/local/tensorrt", "/opt/tensorrt", "/workspace/tensorrt"]
    return [Path(r) for r in roots if r]


def _find_tensorrt_headers(tensorrt_root: str | os.PathLike[str] | None) -> Tool:
    for root in _tensorrt_roots(tensorrt_root):
        for sub in ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu"):
            header = root / sub / "NvInferRuntime.h"
            if header.is_file():
                return Tool("TensorRT headers", str(header.parent), _tensorrt_header_version(header.parent))
    return Tool(
        "TensorRT headers",
        None,
        note="NvInferRuntime.h not found; the pip wheels ship no headers: use the TensorRT tar/deb or an NGC "
        "container and pass --tensorrt-root DIR (or set TENSORRT_ROOT)",
    )


def _tensorrt_header_version(include_dir: Path) -> str | None:
    try:
        text = (include_dir / "NvInferVersion.h").read_text(errors="replace")
    except OSError:
        return None
    parts = [re.search(rf"#define\s+{key}\s+(\d+)", text) for key in ("TRT_MAJOR_ENTERPRISE", "TRT_MINOR_ENTERPRISE")]
    if not all(parts):
        parts = [re.search(rf"#define\s+{key}\s+(\d+)", text) for key in ("NV_TENSORRT_MAJOR", "NV_TENSORRT_MINOR")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def _find_tensorrt_library(tensorrt_root: str | os.PathLike[str] | None) -> Tool:
    names = ("libnvinfer.so", "libnvinfer.so.10", "libnvinfer.so.11")
    dirs = []
    for root in _tensorrt_roots(tensorrt_root):
        dirs += [root / "lib", root / "lib64", root / "lib/x86_64-linux-gnu", root / "lib/aarch64-linux-gnu"]
    # The pip wheel `tensorrt-cu12-libs` (module tensorrt_libs) holds libnvinfer.so.N without headers.
    for entry in sys.path:
        if entry:
            dirs.append(Path(entry) / "tensorrt_libs")
    for d in dirs:
        for name in names:
            if (d / name).is_file():
                return Tool("TensorRT library", str(d / name))
    return Tool("TensorRT library", None, note="libnvinfer.so not found")


def find_tools(tensorrt_root: str | os.PathLike[str] | None = None) -> dict[str, Tool]:
    """What a build would use: nvcc, cmake, the TensorRT headers and library (each possibly not found)."""
    return {
        "nvcc": _find_nvcc(),
        "cmake": _find_cmake(),
        "tensorrt_headers": _find_tensorrt_headers(tensorrt_root),
        "tensorrt_library": _find_tensorrt_library(tensorrt_root),
    }


# ------------------------------------------------------------------------------------------------- building


def forget_foreign_cache(tree: str | os.PathLike[str], source: str | os.PathLike[str]) -> bool:
    """Drop ``tree``'s CMake cache when it was configured from another source folder; whether it did.

    CMake refuses to reconfigure a build tree whose ``CMakeCache.txt`` names another ``CMAKE_HOME_DIRECTORY``
    ("does not match the source ... used to generate cache"): a second checkout, or a reinstall to another path,
    sharing ``~/.cache/layerzero/plugins`` would otherwise fail to build, or keep a library of other sources.
    Only ``CMakeCache.txt`` and ``CMakeFiles/`` go (the tree's objects and configure state); built libraries in
    the folder stay until the build replaces them.
    """
    cache = Path(tree) / "CMakeCache.txt"
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return False
    match = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", text, re.MULTILINE)
    if match is None:
        return False
    configured = Path(match.group(1).strip())
    try:
        same = configured.resolve() == Path(source).resolve()
    except OSError:
        same = False
    if same:
        return False
    logger.info("%s was configured from %s, not %s: reconfiguring", tree, configured, source)
    cache.unlink(missing_ok=True)
    shutil.rmtree(Path(tree) / "CMakeFiles", ignore_errors=True)
    return True


@dataclasses.dataclass
class BuildReport:
    """What ``build_plugins`` found, built, and could not build (with the reason)."""

    build_dir: Path
    tools: dict[str, Tool]
    built: dict[str, Path] = dataclasses.field(default_factory=dict)  # file name -> path
    not_built: dict[str, str] = dataclasses.field(default_factory=dict)  # file name -> why
    error: str | None = None  # configure/compile failure (its log tail), if any
    log: str = ""

    @property
    def ok(self) -> bool:
        """No failure: every library whose prerequisites were found was built."""
        return self.error is None

    @property
    def kernels_built(self) -> bool:
        return LIBRARIES["kernels"] in self.built

    def summary(self) -> str:
        lines = [f"build directory: {self.build_dir}"]
        lines += [f"  {tool.describe()}" for tool in self.tools.values()]
        lines += [f"built      {name}: {path}" for name, path in self.built.items()]
        lines += [f"not built  {name}: {why}" for name, why in self.not_built.items()]
        if self.error:
            lines.append(f"error: {self.error}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "build_dir": str(self.build_dir),
            "tools": {k: dataclasses.asdict(t) for k, t in self.tools.items()},
            "built": {k: str(v) for k, v in self.built.items()},
            "not_built": dict(self.not_built),
            "error": self.error,
        }


def build_plugins(
    build_dir: str | os.PathLike[str] | None = None,
    *,
    tensorrt_root: str | os.PathLike[str] | None = None,
    cuda_architectures: str = "90-real;90-virtual",
    jobs: int = 2,
    build_type: str = "Release",
    timeout_s: float = 1800,
) -> BuildReport:
    """Configure and build ``plugins/`` with CMake into ``build_dir``; report what was built and what not.

    A missing prerequisite (no cmake, no nvcc, no TensorRT) is not an error: the report lists the libraries it
    kept from being built and why. A configure or compile failure is, in ``report.error`` (never raised).
    """
    build = Path(build_dir) if build_dir is not None else default_build_dir()
    tools = find_tools(tensorrt_root)
    report = BuildReport(build_dir=build, tools=tools)
    cmake = tools["cmake"]
    if not cmake.found:
        for name in LIBRARIES.values():
            report.not_built[name] = f"cmake not found ({cmake.note})"
        report.error = "cmake not found: nothing can be built"
        return report

    build.mkdir(parents=True, exist_ok=True)
    forget_foreign_cache(build, source_dir())
    configure = [cmake.path, "-S", str(source_dir()), "-B", str(build), f"-DCMAKE_BUILD_TYPE={build_type}"]
    configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures}")
    if tools["nvcc"].found:
        configure.append(f"-DCMAKE_CUDA_COMPILER={tools['nvcc'].path}")
    else:  # what find_tools reports is what gets built: CMake must not find an nvcc of its own
        configure.append("-DLAYERZERO_WITH_CUDA=OFF")
    if tools["tensorrt_headers"].found:
        configure.append(f"-DTensorRT_INCLUDE_DIR={tools['tensorrt_headers'].path}")
    if tools["tensorrt_library"].found:
        configure.append(f"-DTensorRT_LIBRARY={tools['tensorrt_library'].path}")
    if tensorrt_root is not None:
        configure.append(f"-DTensorRT_ROOT={tensorrt_root}")
    logs: list[str] = []
    if not _run_step(configure, logs, report, timeout_s, "cmake configure"):
        return report
    if not _run_step(
        [cmake.path, "--build", str(build), "-j", str(max(1, jobs))], logs, report, timeout_s, "cmake build"
    ):
        _read_summary(build, report)
        return report
    _read_summary(build, report)
    return report


def _run_step(cmd: list[str], logs: list[str], report: BuildReport, timeout_s: float, what: str) -> bool:
    logger.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        report.error = f"{what} timed out after {timeout_s:.0f} s"
        return False
    except OSError as e:
        report.error = f"{what} could not run: {e}"
        return False
    logs.append(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    report.log = "\n".join(logs)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        report.error = f"{what} failed (exit {proc.returncode}):\n{tail}"
        return False
    return True


def _read_summary(build: Path, report: BuildReport) -> None:
    try:
        summary = json.loads((build / "build_summary.json").read_text())
    except (OSError, ValueError):
        summary = {"targets": {}}
    for name in LIBRARIES.values():
        path = build / name
        status = summary.get("targets", {}).get(name, "")
        if status == "will build" and path.is_file():
            report.built[name] = path
        elif status == "will build":
            report.not_built[name] = "configured but not produced (see the build error)"
        else:
            report.not_built[name] = status.removeprefix("not built: ") or "unknown (no build_summary.json)"
    glue = summary.get("targets", {}).get("layerzero_trt_glue")
    if glue == "will build" and report.error is None:
        report.built[GLUE] = build / "CMakeFiles" / "layerzero_trt_glue.dir"
    elif glue:
        report.not_built[GLUE] = glue.removeprefix("not built: ")


# -------------------------------------------------------------------------------------------------- finding


def plugin_library_path(kind: str = "trt", build_dir: str | os.PathLike[str] | None = None) -> Path:
    """The path of a built library (``kind``: ``kernels``, ``trt`` or ``trt_register``).

    Raises:
        PluginError: unknown kind, or the library is in none of the places searched (the message lists them
            and says how to build it).
    """
    if kind not in LIBRARIES:
        raise PluginError(f"unknown plugin library {kind!r}; known: {', '.join(LIBRARIES)}")
    name = LIBRARIES[kind]
    dirs = []
    if os.environ.get("LAYERZERO_PLUGIN_DIR"):
        dirs.append(Path(os.environ["LAYERZERO_PLUGIN_DIR"]))
    if build_dir is not None:
        dirs.append(Path(build_dir))
    dirs.append(default_build_dir())
    for d in dirs:
        if (d / name).is_file():
            return d / name
    searched = ", ".join(str(d) for d in dirs)
    needs = "nvcc" if kind == "kernels" else "nvcc and the TensorRT headers + libnvinfer"
    raise PluginError(
        f"{name} not found (searched {searched}); build it with `layerzero plugins build` (needs {needs}), "
        "or point LAYERZERO_PLUGIN_DIR at the directory that holds it"
    )


# -------------------------------------------------------------------------------------------------- loading


class MoEConfig(ctypes.Structure):
    """``lz_moe_config`` of layerzero_kernels.h."""

    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("experts", ctypes.c_int64),
        ("top_k", ctypes.c_int32),
        ("normalize", ctypes.c_int32),
        ("scoring", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("zeroing_threshold", ctypes.c_float),
    ]

    @classmethod
    def make(
        cls,
        *,
        tokens: int,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        normalize: bool | int = True,
        scoring: str = "softmax",
        activation: str = "silu",
        zeroing_threshold: float = 0.0,
    ) -> MoEConfig:
        if scoring not in SCORING_CODES:
            raise PluginError(f"scoring {scoring!r} is not one of {', '.join(SCORING_CODES)}")
        if activation not in ACTIVATION_CODES:
            raise PluginError(f"activation {activation!r} is not one of {', '.join(ACTIVATION_CODES)}")
        return cls(
            tokens,
            hidden,
            ffn,
            experts,
            top_k,
            int(normalize),
            SCORING_CODES[scoring],
            ACTIVATION_CODES[activation],
            zeroing_threshold,
        )


_VP = ctypes.c_void_p


class KernelLibrary:
    """``liblayerzero_kernels.so`` through ctypes. Pointers are ints (device addresses), streams too (0 = default).

    Every method raises ``PluginError`` with the library's own message when a call fails.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise PluginError(f"cannot load {self.path}: {e}") from e
        cfg = ctypes.POINTER(MoEConfig)
        lib.lz_abi_version.restype = ctypes.c_int32
        lib.lz_status_string.argtypes, lib.lz_status_string.restype = [ctypes.c_int32], ctypes.c_char_p
        lib.lz_last_error.restype = ctypes.c_char_p
        lib.lz_moe_check_config.argtypes, lib.lz_moe_check_config.restype = [cfg], ctypes.c_int32
        lib.lz_moe_workspace_size.argtypes, lib.lz_moe_workspace_size.restype = [cfg], ctypes.c_size_t
        lib.lz_moe_route.argtypes = [cfg, ctypes.c_int32, _VP, _VP, _VP, _VP, _VP]
        lib.lz_moe_route.restype = ctypes.c_int32
        pointers = [_VP] * 8  # hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace
        lib.lz_moe_forward.argtypes = [cfg, ctypes.c_int32, *pointers, ctypes.c_size_t, _VP]
        lib.lz_moe_forward.restype = ctypes.c_int32
        self._lib = lib
        version = lib.lz_abi_version()
        if version != ABI_VERSION:
            raise PluginError(
                f"{self.path} speaks C ABI version {version}, this layerzero expects {ABI_VERSION}: rebuild it with "
                "`layerzero plugins build`"
            )

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            detail = self._lib.lz_last_error().decode(errors="replace")
            kind = self._lib.lz_status_string(status).decode()
            raise PluginError(f"{what} failed ({kind}): {detail}")

    def check_config(self, config: MoEConfig) -> None:
        self._check(self._lib.lz_moe_check_config(ctypes.byref(config)), "lz_moe_check_config")

    def workspace_size(self, config: MoEConfig) -> int:
        self.check_config(config)
        return int(self._lib.lz_moe_workspace_size(ctypes.byref(config)))

    def route(
        self,
        config: MoEConfig,
        dtype: str,
        router_logits: int,
        topk_index: int | None,
        topk_weight: int | None,
        mask: int | None,
        stream: int = 0,
    ) -> None:
        status = self._lib.lz_moe_route(
            ctypes.byref(config), _dtype_code(dtype), router_logits, topk_index, topk_weight, mask, stream
        )
        self._check(status, "lz_moe_route")

    def forward(
        self,
        config: MoEConfig,
        dtype: str,
        *,
        hidden: int,
        router_logits: int,
        w_gate: int,
        w_up: int,
        w_down: int,
        y: int,
        mask: int | None,
        workspace: int | None,
        workspace_size: int,
        stream: int = 0,
    ) -> None:
        status = self._lib.lz_moe_forward(
            ctypes.byref(config),
            _dtype_code(dtype),
            hidden,
            router_logits,
            w_gate,
            w_up,
            w_down,
            y,
            mask,
            workspace,
            workspace_size,
            stream,
        )
        self._check(status, "lz_moe_forward")


def _dtype_code(dtype: str) -> int:
    key = str(dtype)
    if key not in DTYPE_CODES:
        raise PluginError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_CODES)}")
    return DTYPE_CODES[key]


def load_kernels(
    path: str | os.PathLike[str] | None = None, build_dir: str | os.PathLike[str] | None = None
) -> KernelLibrary:
    """Load ``liblayerzero_kernels.so`` (``path``, else found like ``plugin_library_path("kernels")``)."""
    return KernelLibrary(Path(path) if path is not None else plugin_library_path("kernels", build_dir))
