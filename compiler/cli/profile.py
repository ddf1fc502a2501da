"""Profile a bundle on calibration traffic: per path, how often it runs, how stably it is skipped, its impact.

Runs every request of --data through the bundle and counts, for each dynamic subpath (a MoE expert
<path>.experts.<e>, a gated branch, a group) and each layer the compiler removed: tokens and requests run /
skipped, and zeroing_stability, the longest run of consecutive skips in tokens and in requests. On the first
--impact-samples requests it measures zeroing_impact: the relative L2 change of the path's block output and
of the model output when that path alone is forced off (on an in-memory variant of the compiled model).
Writes a JSON profile (versioned; it names the bundle's model sha256 and its source model's sha256), which
`layerzero compile --profile` solidifies and `layerzero report` draws.

--activations also records, for every projection input of the model (the q/k/v, o, gate/up and down groups of
each layer that `compile --activation-sparsity` thresholds), the distribution of its magnitudes: quantile
tables of |x| and |x|·‖W row‖ pooled over the group (1/1000 apart), per-channel quantiles of |x| (0, 0.05, ...,
1) and the group's output error at each sparsity level. `layerzero compile --profile P --activation-sparsity S`
then calibrates from the profile instead of running its own calibration requests. Profile a dense bundle
(compiled without --activation-sparsity).

--data is an .npz whose arrays have a leading request axis, one per input name ([R, ...]), or a directory
of .npz files, one request each (file-name order). For a causal LM that `layerzero export` wrote, input_ids
alone will do ([R, 1, seq] or [R, seq]): attention_mask, position_ids and an empty past are filled as the first
step of a generation.

examples:
  layerzero profile model.lz --data calib.npz -o profile.json
  layerzero profile model.lz --data requests/ --impact-samples 32
  layerzero profile dense.lz --data calib.npz --activations -o profile.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from layerzero.calibration import load_requests, profile_bundle
from layerzero.cli._common import (
    add_force,
    check_output_file,
    console,
    integer,
    one_line_errors,
    source_of,
    stderr,
    write_file_atomic,
)
from layerzero.errors import InvalidInputError
from layerzero.runtime.path_stats import PROFILE_FORMAT


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("bundle", type=Path, help="a bundle written by `layerzero compile`")
    p.add_argument("--data", type=Path, required=True, metavar="NPZ|DIR", help="calibration requests")
    p.add_argument("-o", "--output", type=Path, default=Path("profile.json"), help="where (default profile.json)")
    p.add_argument(
        "--impact-samples",
        type=integer(0),
        default=8,
        metavar="N",
        help="measure impact on the first N requests (default 8; 0: counters only)",
    )
    p.add_argument(
        "--activations",
        action="store_true",
        help="record each projection input's magnitude distribution (for compile --profile --activation-sparsity)",
    )
    add_force(p, "replace OUTPUT even if it is not a profile")
    p.add_argument("--top", type=integer(0), default=10, metavar="K", help="paths shown in the summary (default 10)")


def run(args: argparse.Namespace) -> int:
    if not (args.bundle / "manifest.json").is_file():
        raise InvalidInputError(f"{args.bundle}: not a bundle (no manifest.json); compile the model first")
    if args.impact_samples < 0:
        raise InvalidInputError(f"--impact-samples {args.impact_samples}: must be >= 0")
    # `-o source.onnx` must never replace the model the bundle came from, --force or not.
    protect = [args.data, *source_of(args.bundle)]
    check_output_file(args.output, "-o", kind="profile", force=args.force, is_ours=_is_profile, protect=protect,
                      protect_dirs=[args.bundle])  # fmt: skip
    requests = load_requests(args.data)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        tasks: dict[str, object] = {}

        def tick(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                label = "requests" if stage == "traffic" else "impact (each path forced off)"
                tasks[stage] = bar.add_task(label, total=total)
            bar.update(tasks[stage], completed=done)

        doc = profile_bundle(
            args.bundle, requests, impact_samples=args.impact_samples, data=str(args.data), on_progress=tick,
            activations=args.activations,
        )  # fmt: skip
    write_file_atomic(args.output, (json.dumps(doc, indent=1) + "\n").encode("utf-8"), "-o")
    _summary(doc, args.top)
    console.print(f"wrote {args.output}")
    return 0


def _is_profile(path: Path) -> bool:
    if path.stat().st_size > 1 << 30:
        return False
    doc = json.loads(path.read_text(encoding="utf-8"))
    return isinstance(doc, dict) and doc.get("format") == PROFILE_FORMAT


def _summary(doc: dict, top: int) -> None:
    traffic = doc["traffic"]
    console.print(
        f"profiled {traffic['requests']} requests ({traffic['tokens']} tokens), "
        f"impact on {doc['impact']['samples']}; {len(doc['paths'])} paths"
    )
    if doc.get("activations"):
        groups = doc["activations"]["groups"]
        rows = max((g["rows"] for g in groups.values()), default=0)
        console.print(f"activations of {len(groups)} projection groups ({rows} token rows each)")
    paths = sorted(
        doc["paths"],
        key=lambda p: (-p["zeroing_stability"]["requests"], -p["tokens"]["skipped"], p["path"]),
    )[:top]
    if not paths:
        return
    table = Table(box=None, pad_edge=False)
    for name in ("path", "kind", "skip rate", "stable (req)", "stable (tok)", "impact model", "params"):
        table.add_column(name, justify="left" if name in ("path", "kind") else "right", no_wrap=name == "path")
    for p in paths:
        tokens = p["tokens"]["run"] + p["tokens"]["skipped"]
        rate = p["tokens"]["skipped"] / tokens if tokens else 0.0
        impact = p["zeroing_impact"]["model"]
        table.add_row(
            p["path"],
            p["kind"] if p["kind"] != "static" else f"static ({p.get('removed_kind')})",
            f"{rate:.1%}",
            str(p["zeroing_stability"]["requests"]),
            str(p["zeroing_stability"]["tokens"]),
            "-" if impact is None else (impact if isinstance(impact, str) else f"{impact:.3g}"),
            f"{p['params']:,}",
        )
    console.print(table)
