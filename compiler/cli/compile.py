"""Compile an ONNX model into an engine bundle, verified against the original.

Runs the static passes (zero flags, constant folding, uniform propagation, dead code) to a
fixpoint, runs the original and the compiled model with onnxruntime on sample inputs, and writes
OUT/ (model.onnx + manifest.json) atomically. On a verification mismatch nothing is written and the
exit code is 1. Bad input (malformed model, unknown op, missing external data) exits 2.

examples:
  layerzero compile model.onnx -o model.lz
  layerzero compile model.onnx -o model.lz --shape input_ids:2,16 --atol 1e-5
  layerzero compile model.onnx -o model.lz --inputs calib.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerzero.cli._common import console, parse_shapes, progress
from layerzero.compile import CompileResult, compile_file
from layerzero.errors import VerificationError
from layerzero.options import CompileOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="the .onnx model to compile")
    p.add_argument("-o", "--output", type=Path, required=True, help="the bundle directory to write")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--shape", action="append", metavar="NAME:D0,D1", help="dims of a dynamic input for verification")
    p.add_argument("--inputs", type=Path, metavar="NPZ", help="sample inputs for verification (.npz)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample inputs")
    p.add_argument("--no-verify", action="store_true", help="skip the numerical verification (not recommended)")
    p.add_argument(
        "--no-assume-finite",
        action="store_true",
        help="do not fold x*0 to 0 (x*0 is NaN when x is NaN or Inf)",
    )
    p.add_argument("--flag-pattern", default="*.flag", help="names of zero flags; '*' is the scope (default *.flag)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def options_from(args: argparse.Namespace) -> CompileOptions:
    return CompileOptions(
        assume_finite=not args.no_assume_finite,
        flag_pattern=args.flag_pattern,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        seed=args.seed,
        shapes=parse_shapes(args.shape),
        sample_inputs=args.inputs,
    )


def print_result(result: CompileResult) -> None:
    b, a = result.before, result.after
    console.print(f"nodes       {b.nodes:>10,} → {a.nodes:,}")
    console.print(f"parameters  {b.params:>10,} → {a.params:,}")
    console.print(f"layers      {len(b.layers):>10} total, {len(result.zeroed_layers)} zeroed")
    for r in result.removed:
        console.print(f"  removed {r.scope:<40} {r.kind:<14} {r.nodes:>5} nodes {r.params:>10,} params")
    print_verification(result.verification)


def print_verification(v) -> None:
    if v is None:
        console.print("verification  skipped (--no-verify)")
        return
    status = "[green]passed[/green]" if v.passed else "[red]FAILED[/red]"
    shapes = ", ".join(f"{k}{v_}" for k, v_ in v.inputs.items())
    console.print(f"verification  {status} at atol={v.atol:g} rtol={v.rtol:g} on {shapes}")
    for o in v.outputs:
        console.print(
            f"  {o.name:<20} max abs {o.max_abs:.3g}  max rel {o.max_rel:.3g}  passes at atol ≥ {o.needed_atol:.3g}"
        )
    for o in v.impact or []:
        console.print(
            f"  impact of the declared zero layers on {o.name}: max abs {o.max_abs:.3g}, max rel {o.max_rel:.3g}"
        )


def run(args: argparse.Namespace) -> int:
    options = options_from(args)
    try:
        with progress(f"compiling {args.model}") as say:
            result = compile_file(args.model, args.output, options, progress=say, overwrite=args.force)
    except VerificationError as exc:
        if exc.result is not None:
            print_verification(exc.result)
        raise
    if args.json:
        console.print_json(json.dumps(result.manifest(args.model, None)))
    else:
        print_result(result)
        console.print(f"wrote {args.output}/ in {result.seconds:.2f} s")
    return 0
