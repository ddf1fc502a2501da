"""Draw a profile as a zeroing map: skip rate per layer (rows) × path (columns), impact marked.

Reads a profile written by `layerzero profile` and writes the heatmap as PNG or SVG, or a self-contained
HTML page (the heatmap inline and a table of every path: counts, stability, impact, parameters), chosen by
the output's suffix. A dot marks a path whose impact is below --impact-tolerance; hatching, a layer removed
at compile time. The HTML table's last column says what `layerzero compile --profile` with the same
--impact-tolerance, --stability-window and --stability-unit (defaults as compile's: 0.01, 100, requests) does
with each path: "removes", or why it keeps it. Needs matplotlib: pip install 'layerzero[report]'.

examples:
  layerzero report profile.json -o map.png
  layerzero report profile.json -o map.html --impact-tolerance 0.001 --stability-window 50
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
from layerzero.report_map import is_report, write_report
from layerzero.runtime.path_stats import load_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("profile", type=Path, help="a profile written by `layerzero profile`")
    p.add_argument("-o", "--output", type=Path, required=True, help="map.png, map.svg or map.html")
    add_impact_tolerance(p, "mark paths whose impact is below T (default 0.01, as compile --profile)")
    add_stability_window(p, "HTML: the table says what compile --profile with this window does (default 100, as "
                            "compile)")
    add_force(p, "replace OUTPUT even if it is not a LayerZero report")
    add_stability_unit(p, "of --stability-window")


def run(args: argparse.Namespace) -> int:
    doc = load_profile(args.profile)
    check_output_file(args.output, "-o", kind="report", force=args.force, is_ours=is_report, protect=[args.profile])
    out = write_report(
        doc, args.output, tolerance=args.impact_tolerance, window=args.stability_window, unit=args.stability_unit
    )
    console.print(f"wrote {out}")
    return 0
