"""Declare zero flags on a model: a one-element initializer <scope>.flag = 0 (or a metadata entry) per scope.

`layerzero compile` then bypasses each flagged layer (README "Zero flags"). A scope can carry a flag when it is
a layer the compiler can bypass: one value leaves it and one entering value has that value's dtype and shape
(the residual stream). --list shows those scopes with their node and parameter counts, the counts `layerzero
inspect` shows (parameters: the weights only that scope reads). In a cache-carrying export a decoder layer and
its self_attn also write present.N.key/value and cannot be flagged; their mlp can.

examples:
  layerzero flag model.onnx --list
  layerzero flag model.onnx model.layers.1 -o flagged.onnx
  layerzero flag model.onnx model.layers.1.mlp model.layers.2.mlp --metadata -o flagged.onnx
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from layerzero.cli._common import add_force, check_output_file, console, one_line_errors
from layerzero.errors import InvalidInputError
from layerzero.summary import PARAMS_CAPTION


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("model", type=Path, help="an .onnx model")
    p.add_argument("scopes", nargs="*", help="scopes to flag (e.g. model.layers.1)")
    p.add_argument("-o", "--output", type=Path, help="the flagged .onnx file to write")
    p.add_argument("--metadata", action="store_true", help="declare the flags as metadata entries, not initializers")
    p.add_argument("--list", action="store_true", help="list the scopes a flag can name and exit")
    add_force(p, "replace an existing output file")


def run(args: argparse.Namespace) -> int:
    import onnx_ir as ir

    from layerzero.flags import add_flags, flaggable_scopes
    from layerzero.loader import load_model

    model = load_model(args.model)
    if args.list:
        table = Table(title=f"scopes a flag can name in {args.model}", caption=PARAMS_CAPTION)
        for col in ("scope", "nodes", "parameters"):
            table.add_column(col, justify="left" if col == "scope" else "right")
        for c in flaggable_scopes(model):
            table.add_row(c.scope, f"{c.nodes:,}", f"{c.params:,}")
        console.print(table)
        return 0
    if args.output is None:
        raise InvalidInputError("-o OUTPUT is required (or --list)")
    # An existing file is replaced only with --force; the input model never (its weights may be mapped).
    check_output_file(args.output, "-o", kind="model", force=args.force, is_ours=lambda _p: False, protect=[args.model])
    names = add_flags(model, list(args.scopes), metadata=args.metadata)
    external = any(
        v.const_value is not None and isinstance(v.const_value, ir.ExternalTensor)
        for v in model.graph.initializers.values()
    )
    if external:  # a large model keeps its weights beside it
        ir.save(model, args.output, external_data=args.output.name + ".data")
    else:
        ir.save(model, args.output)
    form = "metadata entries" if args.metadata else "initializers"
    console.print(f"declared {len(names)} zero flag(s) as {form}: {', '.join(names)} -> {args.output}")
    return 0
