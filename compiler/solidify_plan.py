"""Solidify: turn a profile's always-skipped, harmless paths into paths that are gone.

    layerzero compile model.onnx --profile profile.json --stability-window 100 --impact-tolerance 0.01 -o out.lz

A dynamic subpath (a MoE expert, a gated branch, a group) is removed for good when, in the profile,

- its ``zeroing_stability`` (the longest run of consecutive skips) is at least ``stability_window``, counted in
  requests (``stability_unit="requests"``, the default: a request skips a path when none of its tokens runs
  it) or in tokens (``"tokens"``), and
- its measured ``zeroing_impact`` on the model output (relative L2 change when forced off, the largest over
  the profile's sampled requests) is below ``impact_tolerance``. A path without a measured impact stays.

The profile must come from a bundle compiled from the same source model (the manifest's source sha256).
A MoE block keeps at least ``top_k`` experts: beyond that the candidates with the largest impact stay.
Paths the profiled bundle had solidified already (listed in the profile as static, ``solidified``) stay
removed.

The passes (``layerzero.passes.solidify_paths``) do the removal; verification compares with the original
whose removed paths are forced off (``force_off_reference``), and reports the original's deviation from that
reference as their impact.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.options import CompileOptions
from layerzero.passes._graph import NameFactory, make_constant
from layerzero.passes._moe import find_moe_blocks
from layerzero.passes.shape_inference import InferShapes
from layerzero.runtime.path_stats import load_profile

__all__ = [
    "SolidifyCandidate",
    "SolidifyPlan",
    "force_off_reference",
    "keep_top_k",
    "plan_solidify",
    "solidified_records",
]

logger = logging.getLogger(__name__)

_DYNAMIC_KINDS = ("moe", "gate", "group")


@dataclasses.dataclass
class SolidifyCandidate:
    """A profiled subpath and the numbers that decided it."""

    subpath: str
    parent: str
    kind: str
    params: int
    stability: dict[str, int]
    impact: dict[str, Any]
    reason: str | None = None  # why it stays (None: removed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SolidifyPlan:
    profile: Path
    window: int
    unit: str
    tolerance: float
    requests: int
    removed: list[SolidifyCandidate]
    kept: list[SolidifyCandidate]  # the candidates that stay, with the reason (the stable ones; others omitted)

    @property
    def subpaths(self) -> tuple[str, ...]:
        return tuple(c.subpath for c in self.removed)


def plan_solidify(options: CompileOptions, source_sha256: str | None) -> SolidifyPlan:
    """Read ``options.profile``, check it belongs to the source model, choose the subpaths to remove."""
    assert options.profile is not None
    path = Path(options.profile)
    # stability_unit, stability_window and impact_tolerance were checked when the options were built.
    doc = load_profile(path)
    recorded = (doc.get("source") or {}).get("sha256")
    if source_sha256 is None:
        raise InvalidInputError(f"{path}: solidifying needs the source model as a file (its sha256 is checked)")
    if recorded != source_sha256:
        bundle = (doc.get("bundle") or {}).get("path") or "?"
        raise InvalidInputError(
            f"{path}: the profile belongs to another model: it was recorded on {bundle}, compiled from a source "
            f"with sha256 {str(recorded)[:12]}…, and this model's sha256 is {source_sha256[:12]}…; profile a "
            "bundle compiled from this model"
        )
    removed: list[SolidifyCandidate] = []
    kept: list[SolidifyCandidate] = []
    unit, window, tolerance = options.stability_unit, options.stability_window, options.impact_tolerance
    carried: list[SolidifyCandidate] = []
    for record in doc["paths"]:
        if record.get("kind") == "static" and record.get("removed_kind") == "solidified":
            # Solidified in the profiled bundle already (its traffic ran without it): it stays gone.
            carried.append(
                SolidifyCandidate(
                    subpath=record["path"],
                    parent=str(record.get("parent") or record["path"]),
                    kind="static",
                    params=int(record.get("params") or 0),
                    stability=dict(record.get("zeroing_stability") or {}),
                    impact=dict(record.get("zeroing_impact") or {}),
                )
            )
            continue
        if record.get("kind") not in _DYNAMIC_KINDS:
            continue
        candidate = SolidifyCandidate(
            subpath=record["path"],
            parent=str(record.get("parent") or record["path"]),
            kind=record["kind"],
            params=int(record.get("params") or 0),
            stability=dict(record.get("zeroing_stability") or {}),
            impact=dict(record.get("zeroing_impact") or {}),
        )
        stability = int(candidate.stability.get(unit) or 0)
        impact = candidate.impact.get("model")
        if stability < window:
            continue  # runs too often: not a candidate (not listed)
        if not isinstance(impact, (int, float)):
            candidate.reason = "impact not measured (profile with --impact-samples > 0)"
        elif impact >= tolerance:
            candidate.reason = f"impact {impact:.3g} >= tolerance {tolerance:g}"
        (kept if candidate.reason else removed).append(candidate)
    removed = carried + keep_top_k(removed, kept, doc)
    return SolidifyPlan(
        path, window, unit, tolerance, int((doc.get("traffic") or {}).get("requests") or 0), removed, kept
    )


def keep_top_k(removed: list[SolidifyCandidate], kept: list[SolidifyCandidate], doc: dict) -> list[SolidifyCandidate]:
    """A MoE block keeps at least top_k experts: the candidates with the largest impact stay."""
    experts: dict[str, int] = {}
    for record in doc["paths"]:
        if record.get("kind") == "moe":
            experts[record["parent"]] = experts.get(record["parent"], 0) + 1
    top_k = _top_ks(doc)
    result: list[SolidifyCandidate] = []
    by_block: dict[str, list[SolidifyCandidate]] = {}
    for c in removed:
        (by_block.setdefault(c.parent, []) if c.kind == "moe" else result).append(c)
    for block, candidates in by_block.items():
        room = experts.get(block, 0) - top_k.get(block, 1)
        candidates.sort(key=lambda c: (float(c.impact.get("model") or 0.0), -int(c.params)))
        result.extend(candidates[: max(room, 0)])
        for c in candidates[max(room, 0) :]:
            c.reason = f"{block} keeps at least top_k={top_k.get(block, 1)} experts"
            kept.append(c)
    return result


def _top_ks(doc: dict) -> dict[str, int]:
    """top_k per MoE block, from the profile's ``blocks`` (the bundle's dynamic paths)."""
    return {
        b["path"]: int(b["top_k"])
        for b in doc.get("blocks") or []
        if isinstance(b, dict) and b.get("kind") == "moe" and isinstance(b.get("top_k"), int)
    }


def solidified_records(model: ir.Model, plan: SolidifyPlan | None) -> list[dict[str, Any]]:
    """What went (from the passes' record), with the profile's numbers: the manifest's ``solidified``."""
    from layerzero.passes.solidify_paths import read_solidified

    numbers = {c.subpath: c for c in plan.removed} if plan is not None else {}
    records = []
    for record in read_solidified(model):
        candidate = numbers.get(record["subpath"])
        records.append(
            {
                **record,
                "stability": candidate.stability if candidate else None,
                "impact": candidate.impact if candidate else None,
                "profile": str(plan.profile) if plan is not None else None,
            }
        )
    return records


def check_all_removed(options: CompileOptions, records: list[dict[str, Any]]) -> None:
    """Every requested subpath went; else ``InvalidInputError`` naming the ones this compile does not have."""
    done = {r["subpath"] for r in records}
    missing = [s for s in options.solidify if s not in done]
    if missing:
        raise InvalidInputError(
            f"solidify: {', '.join(map(repr, missing))} is not a dynamic path of this compile (the profile was "
            "recorded on a bundle compiled with other options?); `layerzero compile` lists the dynamic paths"
        )


# --------------------------------------------------------------------------------------------- reference


def force_off_reference(model: ir.Model, options: CompileOptions) -> None:
    """The verification reference: the original with the subpaths of ``options.solidify`` forced off.

    - MoE expert: its router logit is ``-inf`` before the router's scoring, so no token picks it (the original
      experts' computation otherwise as it is).
    - Gated branch: the original's gated branches are rewritten into their exact ``If`` form (threshold 0) and
      the solidified ones get a false condition: ``y = x``.
    - Group: the group reference (``Where(router on, layer, input)``) of ``bypass_declared_layers`` picks the
      input for the solidified groups.
    """
    wanted = set(options.solidify)
    if not wanted:
        return
    graph = model.graph
    names = NameFactory(graph)
    wanted -= _force_off_experts(model, names, wanted)
    wanted -= _force_off_groups(graph, names, wanted)
    if wanted:
        wanted -= _force_off_gates(model, names, wanted)
    if wanted:
        logger.warning(
            "solidify: the verification reference cannot force off %s (not found in the original); it is compared "
            "as the original computes it",
            ", ".join(sorted(wanted)),
        )


def _force_off_experts(model: ir.Model, names: NameFactory, wanted: set[str]) -> set[str]:
    # TopK(Softmax(logits))   ->   TopK(Softmax(Where(off, -inf, logits)))
    InferShapes()(model)
    graph = model.graph
    matches, _ = find_moe_blocks(graph)
    used: set[str] = set()
    done: set[str] = set()
    for i, match in enumerate(matches):
        path = match.path or f"moe_{i}"  # SkipExperts names its blocks this way
        while path in used:
            path = f"{path}_{i}"
        used.add(path)
        off = np.array([f"{path}.experts.{e}" in wanted for e in range(match.experts)])
        if not off.any():
            continue
        done.update(f"{path}.experts.{e}" for e in np.flatnonzero(off))
        logits = match.router.logits
        dtype = logits.dtype.numpy() if logits.dtype is not None else np.float32
        where = ir.Node(
            "",
            "Where",
            [
                make_constant(graph, names, f"{path}.solidified", off),
                make_constant(graph, names, f"{path}.minus_inf", np.array(-np.inf, dtype)),
                logits,
            ],
            name=names(f"/{path}/LzSolidifyWhere"),
        )
        where.outputs[0].name = names(f"{path}.solidified_logits")
        where.outputs[0].type, where.outputs[0].shape = logits.type, logits.shape
        scores = match.router.scores
        scores.replace_input_with(0, where.outputs[0])
        graph.insert_before(scores, where)
    return done


def _force_off_groups(graph: ir.Graph, names: NameFactory, wanted: set[str]) -> set[str]:
    # Where(group on, layer, input)   ->   Where(false, layer, input)
    # The group reference (ApplyGroupMasks, select=True) names each group's decision "<group>__on".
    done: set[str] = set()
    for node in list(graph):
        for value in node.outputs:
            name = value.name or ""
            group = next((g for g in wanted if name == f"{g}__on" or name.startswith(f"{g}__on__lz")), None)
            if group is None or value.dtype != ir.DataType.BOOL:
                continue
            false = make_constant(graph, names, f"{group}.solidified", np.array(False))
            for user, index in list(value.uses()):
                user.replace_input_with(index, false)
            done.add(group)
    return done


def _force_off_gates(model: ir.Model, names: NameFactory, wanted: set[str]) -> set[str]:
    from layerzero.passes._dynamic import read_dynamic_paths
    from layerzero.passes._dynamic_paths import driven_ifs, graph_output
    from layerzero.passes.gated_branches import SkipGatedBranches
    InferShapes()(model)
    before = {p.path for p in read_dynamic_paths(model)}
    SkipGatedBranches(threshold=0.0)(model)
    graph = model.graph
    done: set[str] = set()
    for entry in read_dynamic_paths(model):
        if entry.path in before or entry.kind != "gate":
            continue
        mask = graph_output(graph, entry.mask_output)
        if mask is None:
            continue
        if entry.subpaths[0] in wanted:
            false = make_constant(graph, names, f"{entry.path}.solidified", np.array(False))
            for node in driven_ifs(graph, mask):
                node.replace_input_with(0, false)
            done.add(entry.subpaths[0])
        graph.outputs.remove(mask)  # the reference has the original's outputs only
    return done
