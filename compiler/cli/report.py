"""Draw a profile as a zeroing map: skip rate per layer (rows) × path (columns), impact marked.

Reads a profile written by `layerzero profile` and writes the heatmap as PNG or SVG, or a self-contained
HTML page (the heatmap inline and a table of every path: counts, stability, impact, parameters), chosen by
the output's suffix. A dot marks a path whose impact is below --impact-tolerance; hatching, a layer removed
at compile time. The HTML table's last column says what `layerzero compile --profile` with the same
--impact-tolerance, --stability-window and --stability-unit (defaults as compile's: 0.01, 100, requests) does
with each path: "removes", or why it keeps it. Needs matplotlib: pip install 'layerzero[report]'.

Given a bundle compiled with --activation-sparsity instead (its directory), it prints the activation-sparsity
map: layer (rows) x projection group (qkv, o, gate_up, down), the calibrated sparsity of each group (the
manifest's levels) and, with --realized RUN.json (what `layerzero run BUNDLE --json` printed), the sparsity each
group realized on that request; then the quality-vs-sparsity curve calibration measured (model-wide sparsity ->
the calibration error, or with compile --impact-tolerance the measured output deviation at each level tried).
-o map.html writes the same as a page (no matplotlib needed).

examples:
  layerzero report profile.json -o map.png
  layerzero report profile.json -o map.html --impact-tolerance 0.001 --stability-window 50
  layerzero report sparse.lz
  layerzero run sparse.lz --inputs req.npz --json > run.json && layerzero report sparse.lz --realized run.json -o a.html
"""

from __future__ import annotations

import argparse
from pathlib import Path

from layerzero.cli._common import (
    add_force,
    add_impact_tolerance,
    add_stability_unit,
    add_stability_window,
    check_output_file,
    console,
    one_line_errors,
)
from layerzero.errors import InvalidInputError
from layerzero.report_map import is_report, write_report
from layerzero.runtime.path_stats import load_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument(
        "profile", type=Path, help="a profile written by `layerzero profile`, or a bundle compiled with "
        "--activation-sparsity (its activation-sparsity map)",
    )  # fmt: skip
    p.add_argument("-o", "--output", type=Path, help="map.png, map.svg or map.html (a bundle: map.html, optional)")
    p.add_argument(
        "--realized", type=Path, metavar="RUN.json",
        help="a bundle: the JSON `layerzero run BUNDLE --json` printed; the map shows each group's realized sparsity",
    )  # fmt: skip
    add_impact_tolerance(p, "mark paths whose impact is below T (default 0.01, as compile --profile)")
    add_stability_window(p, "HTML: the table says what compile --profile with this window does (default 100, as "
                            "compile)")
    add_force(p, "replace OUTPUT even if it is not a LayerZero report")
    add_stability_unit(p, "of --stability-window")


def run(args: argparse.Namespace) -> int:
    if (args.profile / "manifest.json").is_file():
        return _bundle(args)
    if args.realized is not None:
        raise InvalidInputError("--realized: only with a bundle (a profile's map shows its own counts)")
    if args.output is None:
        raise InvalidInputError("-o/--output: required with a profile (map.png, map.svg or map.html)")
    doc = load_profile(args.profile)
    check_output_file(args.output, "-o", kind="report", force=args.force, is_ours=is_report, protect=[args.profile])
    out = write_report(
        doc, args.output, tolerance=args.impact_tolerance, window=args.stability_window, unit=args.stability_unit
    )
    console.print(f"wrote {out}")
    return 0


def _read_json(path: Path, what: str) -> object:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInputError(f"{what} {path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"{what} {path}: not readable JSON ({exc})") from None


def _bundle(args: argparse.Namespace) -> int:
    """A bundle with activation sparsity: its map and curve as text, and as HTML with -o."""
    from layerzero.report_map import activation_map, realized_sparsity, render_activation_text, write_activation_report

    manifest = _read_json(args.profile / "manifest.json", "manifest")
    realized = None
    if args.realized is not None:
        realized = realized_sparsity(_read_json(args.realized, "--realized"), f"--realized {args.realized}")
    m = activation_map(manifest, realized, str(args.profile))
    name = str(args.profile)
    source = None if args.realized is None else str(args.realized)
    if args.output is not None:
        protect = [args.profile / "manifest.json", *([args.realized] if args.realized else [])]
        check_output_file(args.output, "-o", kind="report", force=args.force, is_ours=is_report, protect=protect,
                          protect_dirs=[args.profile])  # fmt: skip
        out = write_activation_report(m, args.output, name, source)
    console.print(render_activation_text(m, name, source), end="", markup=False, highlight=False, soft_wrap=True)
    if args.output is not None:
        console.print(f"wrote {out}")
    return 0
