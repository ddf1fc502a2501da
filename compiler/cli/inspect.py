"""Show what a model holds: zero flags, all-zero tensors, layers and scopes with parameters, ops.

examples:
  layerzero inspect model.onnx
  layerzero inspect model.onnx --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from rich.table import Table

from layerzero.cli._common import add_flag_pattern, console
from layerzero.loader import load_model
from layerzero.summary import PARAMS_CAPTION, find_moe, natural_key, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="an .onnx model (or a bundle's model.onnx)")
    add_flag_pattern(p)
    p.add_argument("--depth", type=int, default=2, help="show scopes up to this many levels below a layer")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    path = args.model / "model.onnx" if args.model.is_dir() else args.model
    model = load_model(path)
    s = summarize(model, args.flag_pattern)
    moe = find_moe(model)
    if args.json:
        console.print_json(json.dumps({**s.to_dict(), "moe": [dataclasses.asdict(f) for f in moe]}))
        return 0
    console.print(f"[bold]{path}[/bold]: {s.nodes:,} nodes, {s.params:,} parameters, {len(s.layers)} layers")
    flags = Table(title="zero flags", show_lines=False)
    for col in ("flag", "scope", "value", "form"):
        flags.add_column(col)
    for f in s.flags:
        style = "bold red" if f.value == 0 else ""
        flags.add_row(f.name, f.scope, f"{f.value:g}", f.form, style=style)
    console.print(flags if s.flags else "zero flags: none")
    if s.zero_tensors:
        console.print("all-zero tensors: " + ", ".join(f"{n}{d}" for n, d in s.zero_tensors))
    else:
        console.print("all-zero tensors: none")
    scopes = Table(title="scopes", caption=PARAMS_CAPTION)
    scopes.add_column("scope")
    scopes.add_column("nodes", justify="right")
    scopes.add_column("parameters", justify="right")
    for scope in sorted(s.scope_nodes, key=natural_key):
        if scope.count(".") > args.depth + 1:
            continue
        scopes.add_row(scope, f"{s.scope_nodes[scope]:,}", f"{s.scope_params.get(scope, 0):,}")
    console.print(scopes)
    for finding in moe:
        console.print(finding.line(), style=None if finding.rewritten else "yellow", markup=False)
    console.print("ops: " + ", ".join(f"{op} {n}" for op, n in s.op_histogram.items()))
    return 0
