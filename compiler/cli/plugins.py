"""Build and locate LayerZero's native libraries: the CUDA kernels, the TensorRT plugin, the ONNX Runtime custom ops.

  layerzero plugins build [--build-dir DIR] [--tensorrt-root DIR]   # cmake + nvcc (+ TensorRT)
  layerzero plugins info  [--build-dir DIR] [--tensorrt-root DIR]   # what a build would find; what is built

`build` configures and builds plugins/CMakeLists.txt and prints what it found (nvcc, cmake, the TensorRT
headers and libnvinfer), what it built and what it could not build, and why:

  liblayerzero_kernels.so       the MoE kernels behind a C ABI (needs nvcc)
  liblayerzero_trt.so           the TensorRT plugin layerzero::LayerZeroMoE v1 (needs nvcc + TensorRT);
                                for IPluginRegistry.load_library and trtexec --dynamicPlugins
  liblayerzero_trt_register.so  registers that plugin when loaded: LD_PRELOAD, Triton's
                                --backend-config=tensorrt,plugins=..., trtexec --staticPlugins
  liblayerzero_ort.so           ONNX Runtime CPU custom ops (ai.layerzero::MoE, the native MoE lowering;
                                needs cmake, g++ and the ONNX Runtime headers, which
                                scripts/fetch_ort_headers.sh fetches once); plugins/ort

The default build directory is LAYERZERO_PLUGIN_DIR when it is set (where the TensorRT target and backend and
the native lowerings look first), else ~/.cache/layerzero/plugins (where they look next); once
liblayerzero_ort.so is there, `--moe-lowering auto` picks it. Exit 0 when every library whose prerequisites
were found was built (no nvcc only leaves the CUDA libraries out, no TensorRT the TensorRT ones), 2 when nothing
could be built or a compile failed. --only ort / --only cuda builds one side; --asan builds liblayerzero_ort.so with
AddressSanitizer into BUILD_DIR/asan/.

examples:
  layerzero plugins build
  layerzero plugins build --build-dir build/plugins --tensorrt-root /opt/tensorrt
  layerzero plugins build --only ort                      # the CPU custom ops alone
  LAYERZERO_PLUGIN_DIR=build/plugins layerzero compile model.onnx -o model.lz --target tensorrt
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from layerzero.cli._common import console, integer, one_line_errors, progress
from layerzero.errors import LayerZeroError


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_ in (("build", "configure and build the libraries"), ("info", "what a build would find")):
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument(
            "--build-dir", type=Path, help="CMake build directory (default $LAYERZERO_PLUGIN_DIR, else ~/.cache/...)"
        )
        a.add_argument("--tensorrt-root", type=Path, help="TensorRT install root holding include/ and lib/")
        a.add_argument("--json", action="store_true", help="print the report as JSON")
        if name == "build":
            a.add_argument(
                "--cuda-arch",
                default="90-real;90-virtual",
                help="CMAKE_CUDA_ARCHITECTURES (default: sm_90 code + compute_90 PTX)",
            )
            a.add_argument("-j", "--jobs", type=integer(1, 256), default=2, help="parallel compile jobs (default 2)")
            a.add_argument("--only", choices=("all", "cuda", "ort"), default="all", help="build one side (default all)")
            a.add_argument("--asan", action="store_true", help="liblayerzero_ort.so with AddressSanitizer")


def run(args: argparse.Namespace) -> int:
    from layerzero.plugins import loader, ort_library

    if args.build_dir is None and os.environ.get("LAYERZERO_PLUGIN_DIR"):
        args.build_dir = Path(os.environ["LAYERZERO_PLUGIN_DIR"])  # build where the libraries are looked for first
    if args.action == "info":
        return _info(args, loader)
    report = None
    ort_path: Path | None = None
    ort_error: str | None = None
    with progress("building the LayerZero plugins") as say:
        if args.only in ("all", "cuda"):
            say("cmake (CUDA, TensorRT)")
            report = loader.build_plugins(
                args.build_dir, tensorrt_root=args.tensorrt_root, cuda_architectures=args.cuda_arch, jobs=args.jobs
            )
        if args.only in ("all", "ort"):
            say(f"cmake ({ort_library.ORT_LIBRARY})")
            try:
                ort_path = ort_library.build_ort_library(args.build_dir, asan=args.asan, jobs=args.jobs)
            except loader.PluginError as e:
                ort_error = str(e)
    if args.json:
        out = report.to_dict() if report is not None else {}
        out["ort"] = {"library": None if ort_path is None else str(ort_path), "error": ort_error}
        console.print_json(json.dumps(out, default=str))
    else:
        if report is not None:
            print(report.summary())
        print(f"{ort_library.ORT_LIBRARY}: {ort_path if ort_path is not None else 'not built: ' + str(ort_error)}")
    if report is not None and report.error is not None:
        raise LayerZeroError(report.error.splitlines()[0])
    # A compile failure is an error; a missing prerequisite (cmake, the headers) only with --only ort.
    if ort_error is not None and (args.only == "ort" or ort_error.startswith(f"building {ort_library.ORT_LIBRARY}")):
        raise LayerZeroError(ort_error)
    if report is not None and not report.kernels_built and ort_path is None:
        why = report.not_built.get(loader.LIBRARIES["kernels"], "unknown")
        raise LayerZeroError(
            f"nothing was built: {loader.LIBRARIES['kernels']}: {why}; {ort_library.ORT_LIBRARY}: {ort_error}"
        )
    return 0


def _info(args: argparse.Namespace, loader) -> int:
    from layerzero.plugins import ort_library

    tools = loader.find_tools(args.tensorrt_root)
    libraries = {}
    for kind, name in loader.LIBRARIES.items():
        try:
            libraries[name] = str(loader.plugin_library_path(kind, args.build_dir))
        except loader.PluginError:
            libraries[name] = None
    ort_path = ort_library.find_ort_library(args.build_dir)
    libraries[ort_library.ORT_LIBRARY] = None if ort_path is None else str(ort_path)
    headers = ort_library.find_ort_headers()
    if args.json:
        console.print_json(
            json.dumps(
                {
                    "tools": {k: t.__dict__ for k, t in tools.items()},
                    "ort_headers": None if headers is None else str(headers),
                    "libraries": libraries,
                },
                default=str,
            )
        )
        return 0
    for tool in tools.values():
        print(tool.describe())
    print(f"onnxruntime headers: {headers or 'not fetched (layerzero plugins build fetches them)'}")
    for name, path in libraries.items():
        print(f"{name}: {path or 'not built (layerzero plugins build)'}")
    return 0
