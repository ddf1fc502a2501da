"""The zeroing map: a profile drawn as a heatmap of skip rate per layer (rows) × path (columns).

    layerzero report profile.json -o map.png      # or map.svg, or map.html (the heatmap inline + a table)

Cells are the paths of the profile (``layerzero.runtime.path_stats``): a MoE expert, a gated branch, a group,
a layer removed at compile time. The row is the path's layer (``layers.3``; ``groups`` for a group of
layers, ``model`` for a path outside any layer), the column what it is within the layer (``moe.experts.5``,
``mlp``; a prefix all columns share goes to the axis label). The colour is the skip rate in tokens; a dot
marks an impact below the tolerance (a path ``compile --profile`` may remove, if stable enough); hatching
marks a layer already removed at compile time; grey cells have no path. Needs matplotlib (the ``report``
extra).

A bundle compiled with ``--activation-sparsity`` is drawn as its activation-sparsity map instead (the section
"activation sparsity map" below): text on the terminal, and HTML.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.errors import InvalidInputError
from layerzero.passes._graph import layer_of
from layerzero.summary import natural_key

__all__ = [
    "FORMATS",
    "GENERATOR",
    "ActivationMap",
    "ZeroingGrid",
    "activation_map",
    "check_paths",
    "is_report",
    "realized_sparsity",
    "render_activation_html",
    "render_activation_text",
    "render_html",
    "render_image",
    "write_activation_report",
    "write_report",
    "zeroing_grid",
]

FORMATS = (".png", ".svg", ".html")
#: Written into every report (HTML meta generator, PNG Software, SVG Creator): how `layerzero report` knows
#: a file it may replace without --force.
GENERATOR = "layerzero report"

# A path record as `layerzero profile` writes it: key -> the keys of its sub-record (None: a scalar).
_RECORD_KEYS: dict[str, tuple[str, ...] | None] = {
    "path": None,
    "kind": None,
    "tokens": ("run", "skipped"),
    "requests": ("run", "skipped"),
    "zeroing_stability": ("requests", "tokens"),
    "params": None,
}


def check_paths(doc: dict) -> None:
    """Check the profile's path records have every field the map draws (counts are non-negative integers).

    Raises:
        InvalidInputError: naming the first incomplete record and its missing or bad field.
    """
    paths = doc.get("paths")
    if not isinstance(paths, list):
        raise InvalidInputError("the profile has no list of path records (\"paths\")")
    for index, record in enumerate(paths):
        if not isinstance(record, dict):
            raise InvalidInputError(f"profile path record {index} is not an object")
        name = record.get("path")
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"profile path record {index} has no path name")
        if not isinstance(record.get("kind"), str):
            raise InvalidInputError(f"profile path record {name!r}: kind is missing")
        for key, sub in _RECORD_KEYS.items():
            if sub is None:
                if key == "params" and not _count(record.get(key)):
                    raise InvalidInputError(f"profile path record {name!r}: params must be a non-negative integer")
                continue
            value = record.get(key)
            if not isinstance(value, dict) or not all(_count(value.get(k)) for k in sub):
                raise InvalidInputError(
                    f"profile path record {name!r}: {key} must hold non-negative integers {', '.join(sub)}"
                )
        impact = record.get("zeroing_impact")
        if impact is not None and not isinstance(impact, dict):
            raise InvalidInputError(f"profile path record {name!r}: zeroing_impact must be an object")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_report(path: Path) -> bool:
    """Whether ``path`` is a report `layerzero report` wrote (it carries ``GENERATOR`` near its start)."""
    with open(path, "rb") as f:
        return GENERATOR.encode() in f.read(1 << 16)


def _text(value: Any) -> str:
    """A profile field for the picture's title: a number as is, anything else '?' (no mathtext, no markup)."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


@dataclasses.dataclass
class ZeroingGrid:
    rows: list[str]
    columns: list[str]
    column_label: str  # the prefix the columns share ("" when none)
    rate: np.ndarray  # [rows, columns] skip rate in tokens, NaN where no path
    impact: np.ndarray  # [rows, columns] model-output impact, NaN where unknown
    static: np.ndarray  # [rows, columns] bool: removed at compile time
    paths: dict[tuple[int, int], dict]  # (row, column) -> the profile's path record


def _cell(record: dict) -> tuple[str, str]:
    path = record["path"]
    if record.get("kind") == "group":
        return "groups", path
    layer = layer_of(path)
    if layer is None:
        return "model", path
    return layer, path[len(layer) + 1 :] or "(layer)"


def _impact(record: dict) -> float:
    value = (record.get("zeroing_impact") or {}).get("model")
    if isinstance(value, str):  # "inf"
        return math.inf
    return float(value) if isinstance(value, (int, float)) else math.nan


def zeroing_grid(doc: dict) -> ZeroingGrid:
    cells = {}
    for record in doc["paths"]:
        cells.setdefault(_cell(record), record)
    rows = sorted({r for r, _ in cells}, key=natural_key)
    columns = sorted({c for _, c in cells}, key=natural_key)
    label = ""
    if len(columns) > 1 and all("." in c for c in columns):
        prefix = columns[0].rsplit(".", 1)[0] + "."
        if all(c.startswith(prefix) for c in columns):
            label = prefix
            columns = [c[len(prefix) :] for c in columns]
            cells = {(r, c[len(prefix) :]): v for (r, c), v in cells.items()}
            columns = sorted(columns, key=natural_key)
    shape = (len(rows), len(columns))
    rate, impact, static = np.full(shape, np.nan), np.full(shape, np.nan), np.zeros(shape, bool)
    paths: dict[tuple[int, int], dict] = {}
    for (r, c), record in cells.items():
        i, j = rows.index(r), columns.index(c)
        run, skipped = record["tokens"]["run"], record["tokens"]["skipped"]
        rate[i, j] = skipped / (run + skipped) if run + skipped else (1.0 if record.get("kind") == "static" else 0.0)
        impact[i, j] = _impact(record)
        static[i, j] = record.get("kind") == "static"
        paths[(i, j)] = record
    return ZeroingGrid(rows, columns, label, rate, impact, static, paths)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InvalidInputError(
            "the zeroing map needs matplotlib: pip install 'layerzero[report]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_image(doc: dict, fmt: str = "png", *, tolerance: float = 0.01) -> bytes:
    """The heatmap as PNG or SVG bytes."""
    plt = _pyplot()

    check_paths(doc)
    # Path names come from the profile: '$' must not start matplotlib's mathtext (a parse error, or markup).
    with plt.rc_context({"text.parse_math": False}):
        return _render_image(plt, doc, fmt, tolerance)


def _render_image(plt: Any, doc: dict, fmt: str, tolerance: float) -> bytes:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    grid = zeroing_grid(doc)
    n_rows, n_cols = len(grid.rows), len(grid.columns)
    fig_w = min(max(5.5, 1.8 + 0.62 * n_cols), 24)
    fig_h = min(max(3.2, 1.9 + 0.46 * n_rows), 30)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=150, layout="constrained")
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e6e6e6")
    image = ax.imshow(np.ma.masked_invalid(grid.rate), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), _record in grid.paths.items():
        rate = grid.rate[i, j]
        dark = rate < 0.6
        ax.text(j, i + 0.18, _percent(rate), ha="center", va="center", fontsize=7, color="white" if dark else "black")
        if grid.static[i, j]:
            ax.add_patch(
                plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#555555", linewidth=0)
            )
        elif grid.impact[i, j] < tolerance:
            ax.plot(
                j, i - 0.2, "o", markersize=5, markerfacecolor="white", markeredgecolor="black", markeredgewidth=0.8
            )
    ax.set_xticks(range(n_cols), grid.columns, rotation=45 if max(map(len, grid.columns), default=0) > 3 else 0)
    ax.set_yticks(range(n_rows), grid.rows)
    ax.set_xticks(np.arange(-0.5, n_cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, n_rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"{grid.column_label}<column>" if grid.column_label else "path")
    ax.set_ylabel("layer")
    traffic = doc.get("traffic") or {}
    bundle = Path(str((doc.get("bundle") or {}).get("path") or "")).name or "bundle"
    ax.set_title(
        f"Zeroing map of {bundle}: skip rate per path\n"
        f"{_text(traffic.get('requests'))} requests, {_text(traffic.get('tokens'))} tokens; "
        f"impact on {_text((doc.get('impact') or {}).get('samples', 0))} sampled requests",
        fontsize=9,
    )
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("skip rate (tokens)", fontsize=8)
    bar.ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    handles = [
        Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor="black",
               label=f"impact < {tolerance:g} (relative L2 change of the output with the path forced off)"),
    ]  # fmt: skip
    if grid.static.any():
        handles.append(Patch(facecolor=cmap(1.0), hatch="///", edgecolor="#555555", label="removed at compile time"))
    if np.isnan(grid.rate).any():
        handles.append(Patch(facecolor="#e6e6e6", label="no such path"))
    ncol = len(handles) if fig_w >= 9 else 1
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=7, frameon=False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, metadata={"Software" if fmt == "png" else "Creator": GENERATOR})
    plt.close(fig)
    return buffer.getvalue()


def _percent(rate: float) -> str:
    """A whole percentage that never rounds a path that ran (or skipped) once to 100 % (or 0 %)."""
    if 0.995 <= rate < 1.0:
        return ">99%"
    if 0.0 < rate < 0.005:
        return "<1%"
    return f"{rate:.0%}"


def _fmt(value: Any, percent: bool = False) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return f"{value:.1%}" if percent else f"{value:.3g}"


#: compile --profile's defaults (``layerzero compile --stability-window``, ``--stability-unit``).
COMPILE_WINDOW, COMPILE_UNIT = 100, "requests"


def compile_decisions(doc: dict, *, tolerance: float, window: int, unit: str) -> dict[str, str]:
    """For each dynamic path of the profile, what ``compile --profile`` with these settings does with it:
    ``"removes"``, or why it keeps it. The rules are ``solidify_plan.plan_solidify``'s: skipped at least
    ``window`` consecutive ``unit``, a measured impact below ``tolerance``, and a MoE block keeps top_k experts."""
    from layerzero.solidify_plan import SolidifyCandidate, keep_top_k

    decisions: dict[str, str] = {}
    removed: list[SolidifyCandidate] = []
    for record in doc["paths"]:
        if record["kind"] == "static":
            continue
        stability = int((record.get("zeroing_stability") or {}).get(unit) or 0)
        impact = (record.get("zeroing_impact") or {}).get("model")
        if stability < window:
            decisions[record["path"]] = f"keeps: skipped at most {stability:,} consecutive {unit} (< {window:,})"
        elif not isinstance(impact, (int, float)):
            decisions[record["path"]] = "keeps: impact not measured"
        elif impact >= tolerance:
            decisions[record["path"]] = f"keeps: impact {impact:.3g} ≥ {tolerance:g}"
        else:
            removed.append(
                SolidifyCandidate(
                    subpath=record["path"],
                    parent=str(record.get("parent") or record["path"]),
                    kind=record["kind"],
                    params=int(record.get("params") or 0),
                    stability=dict(record.get("zeroing_stability") or {}),
                    impact=dict(record.get("zeroing_impact") or {}),
                )
            )
    kept: list[SolidifyCandidate] = []
    for c in keep_top_k(removed, kept, doc):
        decisions[c.subpath] = "removes"
    for c in kept:
        decisions[c.subpath] = f"keeps: {c.reason}"
    return decisions


def render_html(
    doc: dict, *, tolerance: float = 0.01, window: int | None = COMPILE_WINDOW, unit: str = COMPILE_UNIT
) -> str:
    """A self-contained page: the heatmap (inline PNG) and a table of every path.

    The last column says what ``layerzero compile --profile`` with ``--impact-tolerance tolerance
    --stability-window window --stability-unit unit`` (compile's defaults: 0.01, 100, requests) does with each
    dynamic path; ``window=None`` is compile's default window.
    """
    window = COMPILE_WINDOW if window is None else window
    decisions = compile_decisions(doc, tolerance=tolerance, window=window, unit=unit)
    png = base64.b64encode(render_image(doc, "png", tolerance=tolerance)).decode("ascii")
    traffic = doc.get("traffic") if isinstance(doc.get("traffic"), dict) else {}
    source = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    bundle = doc.get("bundle") if isinstance(doc.get("bundle"), dict) else {}
    esc = html.escape  # every profile field is text from a file: escape each one (no script injection)
    rows = []
    for record in sorted(doc["paths"], key=lambda r: natural_key(r["path"])):
        tokens = record["tokens"]["run"] + record["tokens"]["skipped"]
        rate = record["tokens"]["skipped"] / tokens if tokens else None
        stability = record["zeroing_stability"]
        impact = record.get("zeroing_impact") or {}
        model = impact.get("model")
        kind = record["kind"] if record["kind"] != "static" else f"static ({record.get('removed_kind', '?')})"
        cells = [
            record["path"],
            kind,
            _fmt(rate, percent=True),
            f"{record['tokens']['run']:,} / {record['tokens']['skipped']:,}",
            f"{record['requests']['run']:,} / {record['requests']['skipped']:,}",
            f"{stability['requests']:,}",
            f"{stability['tokens']:,}",
            _fmt(impact.get("block")),
            _fmt(model),
            f"{record['params']:,}",
            "already removed" if record["kind"] == "static" else decisions.get(record["path"], ""),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    header = [
        "path", "kind", "skip rate", "tokens run / skipped", "requests run / skipped", "stable (requests)",
        "stable (tokens)", "impact (block)", "impact (model)", "params", "compile --profile",
    ]  # fmt: skip
    settings = f"--impact-tolerance {tolerance:g} --stability-window {window} --stability-unit {html.escape(unit)}"
    criterion = (
        f"what <code>layerzero compile --profile PROFILE {settings}</code> does with each path: it removes a path "
        f"skipped ≥ {window} consecutive {html.escape(unit)} whose impact (model) is &lt; {tolerance:g}, and a MoE "
        "block keeps at least top_k experts (the ones with the largest impact stay); other windows and tolerances: "
        "<code>layerzero report --stability-window N --impact-tolerance T</code>"
    )
    title = f"LayerZero zeroing map: {esc(str(bundle.get('path') or 'bundle'))}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
img {{ max-width: 100%; height: auto; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }}
th:nth-child(-n+2), td:nth-child(-n+2) {{ text-align: left; }}
th {{ background: #f3f3f3; position: sticky; top: 0; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head>
<body>
<h1>{title}</h1>
<p>{esc(str(traffic.get("requests", "?")))} requests, {esc(str(traffic.get("tokens", "?")))} tokens
(data: <code>{esc(str(traffic.get("data")))}</code>); source model sha256
<code>{esc(str(source.get("sha256")))}</code>; profile format {esc(str(doc.get("format")))} \
v{esc(str(doc.get("version")))}.</p>
<img alt="zeroing map: skip rate per layer and path" src="data:image/png;base64,{png}">
<h2>Paths</h2>
<p>Skip rate and run / skip counts in tokens and requests; stability = the longest run of consecutive skips;
impact = the relative L2 change of the block / model output when the path alone is forced off (largest over
the sampled requests). Last column, {criterion}.</p>
<table>
<thead><tr>{"".join(f"<th>{h}</th>" for h in header)}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
</body></html>
"""


def write_report(
    doc: dict,
    out: str | Path,
    *,
    tolerance: float = 0.01,
    window: int | None = COMPILE_WINDOW,
    unit: str = COMPILE_UNIT,
) -> Path:
    """Write the map as ``.png``, ``.svg`` or ``.html`` (by ``out``'s suffix)."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise InvalidInputError(f"{out}: the report is written as {', '.join(FORMATS)} (by the file's suffix)")
    check_paths(doc)
    if not doc["paths"]:
        raise InvalidInputError("the profile has no paths to draw (the bundle has no dynamic or removed path)")
    if suffix == ".html":
        data = render_html(doc, tolerance=tolerance, window=window, unit=unit).encode("utf-8")
    else:
        data = render_image(doc, suffix[1:], tolerance=tolerance)
    return _write_atomically(out, data)


def _write_atomically(out: Path, data: bytes) -> Path:
    """Temp file + rename: a reader never sees half a report, a failure leaves the old one."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InvalidInputError(f"{out}: cannot write the report: {e.strerror or e}") from None
    return out


# ------------------------------------------------------------------------------------- activation sparsity map
#
# `layerzero report BUNDLE`: a bundle compiled with --activation-sparsity drawn as its sparsity map, layer (rows) x
# projection group (columns: self_attn.qkv, self_attn.o, mlp.gate_up, mlp.down), the calibrated level of each group
# (manifest "activation_sparsity" "groups") and, given the JSON `layerzero run --json` printed, the sparsity each
# group realized on that request (its report's "activation_sparsity"); and the quality-vs-sparsity curve the
# calibration measured (manifest "curve": model-wide sparsity -> the calibration's error; with --impact-tolerance,
# the measured model-output deviation at each level tried).


@dataclasses.dataclass
class ActivationMap:
    rows: list[str]  # layers
    columns: list[str]  # group names within a layer
    level: np.ndarray  # [rows, columns] calibrated sparsity, NaN where no group
    realized: np.ndarray | None  # [rows, columns] realized sparsity (from a run's report), NaN where not reported
    record: dict  # the manifest's activation_sparsity record
    curve: list[tuple[float, float]]
    curve_label: str


def _activation_record(manifest: dict, where: str) -> dict:
    record = manifest.get("activation_sparsity") if isinstance(manifest, dict) else None
    if not isinstance(record, dict):
        raise InvalidInputError(
            f"{where}: the bundle has no activation sparsity (compile it with --activation-sparsity S); "
            "`layerzero report` draws a profile (layerzero profile) or such a bundle"
        )
    groups = record.get("groups")
    if not isinstance(groups, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in groups.items()
    ):
        raise InvalidInputError(f"{where}: the manifest's activation_sparsity has no groups (name -> level)")
    curve = record.get("curve")
    if not isinstance(curve, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p) for p in curve
    ):
        raise InvalidInputError(f"{where}: the manifest's activation_sparsity curve is not a list of [sparsity, error]")
    return record


def realized_sparsity(doc: object, where: str) -> dict[str, float]:
    """The per-group realized sparsity of the JSON `layerzero run --json` printed (``report.activation_sparsity``;
    a bare report, or its ``activation_sparsity`` alone, will do)."""
    report = doc.get("report", doc) if isinstance(doc, dict) else None
    values = report.get("activation_sparsity", report) if isinstance(report, dict) else None
    if not isinstance(values, dict) or not values or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()
    ):
        raise InvalidInputError(
            f"{where}: no per-group activation sparsity in it (give the JSON `layerzero run BUNDLE --json` printed)"
        )
    return {str(k): float(v) for k, v in values.items()}


def activation_map(manifest: dict, realized: dict[str, float] | None = None, where: str = "bundle") -> ActivationMap:
    record = _activation_record(manifest, where)
    cells: dict[tuple[str, str], str] = {}
    for name in record["groups"]:
        layer = layer_of(name)
        cells[(layer or "model", name[len(layer) + 1 :] if layer else name)] = name
    rows = sorted({r for r, _ in cells}, key=natural_key)
    order = {"self_attn.qkv": 0, "self_attn.o": 1, "mlp.gate_up": 2, "mlp.down": 3}
    columns = sorted({c for _, c in cells}, key=lambda c: (order.get(c, 9), natural_key(c)))
    level = np.full((len(rows), len(columns)), np.nan)
    seen = np.full_like(level, np.nan)
    for (r, c), name in cells.items():
        i, j = rows.index(r), columns.index(c)
        level[i, j] = float(record["groups"][name])
        if realized is not None and name in realized:
            seen[i, j] = realized[name]
    if realized is not None and not set(realized) & set(record["groups"]):
        raise InvalidInputError(f"{where}: the run's report names none of the bundle's activation groups")
    measured = record.get("impact_tolerance") is not None
    label = "measured deviation (largest relative L2 change of an output)" if measured else (
        "calibration error (sum of the groups' relative output errors)"
    )  # fmt: skip
    curve = [(float(s), float(e)) for s, e in record["curve"]]
    return ActivationMap(rows, columns, level, None if realized is None else seen, record, curve, label)


def _cell_text(level: float, realized: float | None) -> str:
    if math.isnan(level):
        return "–"
    text = f"{level:.1%}"
    if realized is not None and not math.isnan(realized):
        text += f" ({realized:.1%})"
    return text


def _headline(m: ActivationMap) -> str:
    r = m.record
    text = (
        f"target {_fmt(r.get('target'))}, {r.get('allocation', '?')} allocation, {r.get('method', '?')} criterion, "
        f"{r.get('form', '?')} form; realized {_fmt(r.get('realized_on_calibration'))} on {r.get('calibration', '?')}"
    )
    if r.get("impact_tolerance") is not None:
        text += (
            f"; impact tolerance {_fmt(r['impact_tolerance'])}: chose {_fmt(r.get('chosen'))} "
            f"(deviation {_fmt(r.get('impact'))})"
        )
    rotation = r.get("rotation")
    if isinstance(rotation, dict):
        text += f"; {rotation.get('kind', '?')} rotated in {rotation.get('layers', 0)} attentions"
        if rotation.get("refused"):
            text += f" ({len(rotation['refused'])} left: {rotation['refused'][0].get('reason', '?')})"
    return text


def render_activation_text(m: ActivationMap, bundle: str = "bundle", realized_from: str | None = None) -> str:
    """The map and the curve as plain text (what `layerzero report BUNDLE` prints)."""
    lines = [f"activation sparsity of {bundle}: {_headline(m)}"]
    what = "calibrated sparsity per group" + (f" (realized on {realized_from} in brackets)" if realized_from else "")
    lines.append(f"sparsity map, layer x projection group: {what}")
    cells = [["layer", *m.columns]]
    for i, row in enumerate(m.rows):
        cells.append([row] + [
            _cell_text(m.level[i, j], None if m.realized is None else m.realized[i, j]) for j in range(len(m.columns))
        ])  # fmt: skip
    widths = [max(len(r[k]) for r in cells) for k in range(len(cells[0]))]
    for r in cells:
        lines.append("  " + "  ".join(v.ljust(w) if k == 0 else v.rjust(w) for k, (v, w) in enumerate(zip(r, widths))))
    lines.append(f"quality vs sparsity ({len(m.curve)} points): model-wide sparsity -> {m.curve_label}")
    top = max((e for _, e in m.curve if math.isfinite(e)), default=0.0) or 1.0
    for s, e in m.curve:
        bar = "#" * round(40 * min(e, top) / top) if math.isfinite(e) else "(not finite)"
        lines.append(f"  {s:8.4f}  {e:11.4g}  {bar}")
    return "\n".join(lines) + "\n"


def _curve_svg(m: ActivationMap) -> str:
    """The curve as an inline SVG line chart (no matplotlib)."""
    w, h, pad = 520, 260, 44
    points = [(s, e) for s, e in m.curve if math.isfinite(e)]
    xmax = max((s for s, _ in points), default=1.0) or 1.0
    ymax = max((e for _, e in points), default=1.0) or 1.0

    def xy(s: float, e: float) -> str:
        return f"{pad + s / xmax * (w - 2 * pad):.1f},{h - pad - e / ymax * (h - 2 * pad):.1f}"

    line = " ".join(xy(s, e) for s, e in points)
    dots = "".join(f'<circle cx="{xy(s, e).split(",")[0]}" cy="{xy(s, e).split(",")[1]}" r="3"/>' for s, e in points)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
        f'aria-label="quality vs sparsity">'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#444"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#444"/>'
        f'<polyline fill="none" stroke="#2a6ebb" stroke-width="2" points="{line}"/><g fill="#2a6ebb">{dots}</g>'
        f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle" font-size="12">model-wide sparsity (0 – {xmax:.3g})</text>'
        f'<text x="12" y="{pad - 14}" font-size="12">{html.escape(m.curve_label)} (0 – {ymax:.3g})</text></svg>'
    )


def render_activation_html(m: ActivationMap, bundle: str = "bundle", realized_from: str | None = None) -> str:
    """A self-contained page: the map as a table coloured by level, the curve (inline SVG) and its points."""
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in ["layer", *m.columns])
    body = []
    for i, row in enumerate(m.rows):
        cells = [f"<td>{esc(row)}</td>"]
        for j in range(len(m.columns)):
            level = m.level[i, j]
            shade = "" if math.isnan(level) else f' style="background: hsl(210, 70%, {96 - 50 * level:.0f}%)"'
            realized = None if m.realized is None else m.realized[i, j]
            cells.append(f"<td{shade}>{esc(_cell_text(level, realized))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    points = "".join(f"<tr><td>{s:.4f}</td><td>{e:.4g}</td></tr>" for s, e in m.curve)
    note = f" (realized on <code>{esc(realized_from)}</code> in brackets)" if realized_from else ""
    title = f"LayerZero activation sparsity: {esc(bundle)}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }}
th, td {{ padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #f3f3f3; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head>
<body>
<h1>{title}</h1>
<p>{esc(_headline(m))}.</p>
<h2>Sparsity map</h2>
<p>Calibrated sparsity of each projection group's input, per layer{note}.</p>
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
<h2>Quality vs sparsity</h2>
<p>Model-wide sparsity (parameter-weighted) against the {esc(m.curve_label)}, as calibration measured it.</p>
{_curve_svg(m)}
<table><thead><tr><th>sparsity</th><th>{esc(m.curve_label)}</th></tr></thead><tbody>{points}</tbody></table>
</body></html>
"""


def write_activation_report(m: ActivationMap, out: str | Path, bundle: str, realized_from: str | None) -> Path:
    """The map as ``.html`` (atomically; PNG / SVG are the profile map's formats only)."""
    out = Path(out)
    if out.suffix.lower() != ".html":
        raise InvalidInputError(f"{out}: a bundle's activation-sparsity map is written as .html")
    data = render_activation_html(m, bundle, realized_from).encode("utf-8")
    return _write_atomically(out, data)
