"""Build and locate LayerZero's native libraries: the CUDA kernels and the TensorRT plugin.

  layerzero plugins build [--build-dir DIR] [--tensorrt-root DIR]   # cmake + nvcc (+ TensorRT)
  layerzero plugins info  [--build-dir DIR] [--tensorrt-root DIR]   # what a build would find; what is built

`build` configures and builds plugins/CMakeLists.txt and prints what it found (nvcc, cmake, the TensorRT
headers and libnvinfer), what it built and what it could not build, and why:

  liblayerzero_kernels.so       the MoE kernels behind a C ABI (needs nvcc)
  liblayerzero_trt.so           the TensorRT plugin layerzero::LayerZeroMoE v1 (needs nvcc + TensorRT);
                                for IPluginRegistry.load_library and trtexec --dynamicPlugins
  liblayerzero_trt_register.so  registers that plugin when loaded: LD_PRELOAD, Triton's
                                --backend-config=tensorrt,plugins=..., trtexec --staticPlugins

The default build directory is ~/.cache/layerzero/plugins, where the TensorRT target and backend look (as
they look in LAYERZERO_PLUGIN_DIR). Exit 0 when every library whose prerequisites were found was built (no
TensorRT only leaves the TensorRT libraries out), 2 when nothing could be built (no cmake, no nvcc) or a
compile failed.

examples:
  layerzero plugins build
  layerzero plugins build --build-dir build/plugins --tensorrt-root /opt/tensorrt
  LAYERZERO_PLUGIN_DIR=build/plugins layerzero compile model.onnx -o model.lz --target tensorrt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerzero.cli._common import console, integer, one_line_errors, progress
from layerzero.errors import LayerZeroError


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_ in (("build", "configure and build the libraries"), ("info", "what a build would find")):
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument("--build-dir", type=Path, help="CMake build directory (default ~/.cache/layerzero/plugins)")
        a.add_argument("--tensorrt-root", type=Path, help="TensorRT install root holding include/ and lib/")
        a.add_argument("--json", action="store_true", help="print the report as JSON")
        if name == "build":
            a.add_argument(
                "--cuda-arch",
                default="90-real;90-virtual",
                help="CMAKE_CUDA_ARCHITECTURES (default: sm_90 code + compute_90 PTX)",
            )
            a.add_argument("-j", "--jobs", type=integer(1, 256), default=2, help="parallel compile jobs (default 2)")


def run(args: argparse.Namespace) -> int:
    from layerzero.plugins import loader

    if args.action == "info":
        return _info(args, loader)
    with progress("building the LayerZero plugins") as say:
        say("cmake")
        report = loader.build_plugins(
            args.build_dir, tensorrt_root=args.tensorrt_root, cuda_architectures=args.cuda_arch, jobs=args.jobs
        )
    if args.json:
        console.print_json(json.dumps(report.to_dict()))
    else:
        print(report.summary())
    if report.error is not None:
        raise LayerZeroError(report.error.splitlines()[0])
    if not report.kernels_built:
        why = report.not_built.get(loader.LIBRARIES["kernels"], "unknown")
        raise LayerZeroError(f"nothing was built: {loader.LIBRARIES['kernels']}: {why}")
    return 0


def _info(args: argparse.Namespace, loader) -> int:
    tools = loader.find_tools(args.tensorrt_root)
    libraries = {}
    for kind, name in loader.LIBRARIES.items():
        try:
            libraries[name] = str(loader.plugin_library_path(kind, args.build_dir))
        except loader.PluginError:
            libraries[name] = None
    if args.json:
        console.print_json(
            json.dumps({"tools": {k: t.__dict__ for k, t in tools.items()}, "libraries": libraries}, default=str)
        )
        return 0
    for tool in tools.values():
        print(tool.describe())
    for name, path in libraries.items():
        print(f"{name}: {path or 'not built (layerzero plugins build)'}")
    return 0
