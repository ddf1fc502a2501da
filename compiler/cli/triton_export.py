"""Write a Triton Inference Server model repository for a compiled bundle.

Two models, each with its config.pbtxt (max_batch_size 0, dims -1 where dynamic):

  REPO/NAME/        Python backend: the LayerZero runtime with the guard (sampling, fallback, kill switch)
                    and Triton custom metrics; user outputs only (skip masks stripped). The Triton Python
                    environment needs layerzero installed. Control: write 1/control.json, e.g.
                    {"kill_switch": true} or {"threshold": 0.05}; it is re-read when it changes.
  REPO/NAME_onnx/   onnxruntime backend (platform onnxruntime_onnx): the compiled model.onnx as is, every
                    graph output listed (layerzero::mask::* included).

The reference for the guard is --reference, or the model the bundle was compiled from when it is still there
unchanged; it is copied into the repository. Other models in REPO are left alone.

examples:
  layerzero triton-export model.lz repo/
  layerzero triton-export model.lz repo/ --name llama --reference model.onnx --sample-rate 0.05 --instances 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from layerzero.cli._common import add_force, add_guard_arguments, console, integer, one_line_errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("bundle", type=Path, help="a bundle written by `layerzero compile`")
    p.add_argument("repo", type=Path, help="the model repository directory (created if missing)")
    p.add_argument("--name", default="layerzero", help="the Python-backend model's name (default layerzero)")
    p.add_argument("--onnx-name", help="the onnxruntime-backend model's name (default NAME_onnx)")
    add_guard_arguments(p)
    p.add_argument("--instances", type=integer(1, 64), default=1, help="Python-backend instances (default 1)")
    p.add_argument("--gpu", action="store_true", help="run the onnxruntime model on the GPU (KIND_GPU)")
    add_force(p, "replace the two models if they exist")


def run(args: argparse.Namespace) -> int:
    from layerzero.runtime.bundle import read_bundle
    from layerzero.runtime.guard import GuardConfig
    from layerzero.runtime.triton_repo import default_reference, export_triton_repository

    reference = None
    if not args.no_reference:
        reference = args.reference or default_reference(read_bundle(args.bundle).manifest)
    sample_rate = args.sample_rate if args.sample_rate is not None else (0.01 if reference is not None else 0.0)
    guard = GuardConfig(sample_rate=sample_rate, fallback_bound=args.fallback_bound, max_tokens=args.max_tokens)
    written = export_triton_repository(
        args.bundle,
        args.repo,
        name=args.name,
        onnx_name=args.onnx_name,
        reference=reference,
        no_reference=reference is None,
        guard=guard,
        instances=args.instances,
        onnx_kind="KIND_GPU" if args.gpu else "KIND_CPU",
        overwrite=args.force,
    )
    for path in written:
        console.print(f"wrote {path}/config.pbtxt")
    console.print(f"reference: {reference or 'none (guard off)'}; run: tritonserver --model-repository {args.repo}")
    return 0
